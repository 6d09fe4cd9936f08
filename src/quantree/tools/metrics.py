"""Accuracy metrics used by the report, the demo and the tests."""

from __future__ import annotations

import math

import torch


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when equal)."""
    reference, test = reference.detach().double(), test.detach().double()
    noise = (reference - test).pow(2).mean().item()
    signal = reference.pow(2).mean().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-30) / noise)
