"""Accuracy metrics used by the report, the demo and the tests."""

from __future__ import annotations

import math

import torch


def sqnr_from_energies(signal: float, noise: float) -> float:
    """SQNR in dB from summed squares: ``inf`` when exact, ``-inf`` when the float tensor is
    all zero and the quantized one is not.

    A zero float tensor (a fresh layer's zero bias, a masked row) has no signal to compare
    the error against; a floor under the signal printed it as a finite -250 dB, which read as
    a measurement and changed by 3 dB between a sum and a mean of the same squares.
    """
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sqnr_text(value: float) -> str:
    """How tables, charts and the CLI print an SQNR: dB, or what an infinite value means."""
    if value == math.inf:
        return "exact"
    if value == -math.inf:
        return "float 0"
    return f"{value:.1f}"


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when equal, -inf when only the
    reference is zero)."""
    reference, test = reference.detach().double(), test.detach().double()
    noise = (reference - test).pow(2).mean().item()
    signal = reference.pow(2).mean().item()
    return sqnr_from_energies(signal, noise)
