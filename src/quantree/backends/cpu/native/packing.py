"""Weight layout of the native kernels: int8 VNNI blocks plus zero-point corrections.

A weight ``[N, K]`` becomes ``[ceil(N / 16), ceil(K / 4), 64]`` int8: each 64-byte row
holds 4 consecutive k of 16 output channels, which is what one ``vpdpbusd`` consumes. The
kernels read activations as ``x + 128`` (uint8), so the exact int32 result needs
``-(zero_point + 128) * sum_k w[n, k]``, computed here once per weight.
"""

from __future__ import annotations

import torch


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An int8 ``[N, ...]`` weight (rows flattened in order) in the kernels' blocked layout."""
    w = weight.reshape(weight.shape[0], -1)
    if w.dtype != torch.int8:
        raise TypeError(f"pack expects an int8 weight, got {w.dtype}")
    n, k = w.shape
    np_, kp = -(-n // 16) * 16, -(-k // 4) * 4
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = w
    blocks = padded.view(np_ // 16, 16, kp // 4, 4).permute(0, 2, 1, 3)
    return blocks.contiguous().view(np_ // 16, kp // 4, 64)


def row_sums(weight: torch.Tensor) -> torch.Tensor:
    """int32 ``[N]``: ``sum_k w[n, k]``, for the zero-point correction."""
    return weight.reshape(weight.shape[0], -1).to(torch.int32).sum(1, dtype=torch.int32)


def zero_point_offset(weight: torch.Tensor, input_zero_point: int) -> torch.Tensor:
    """int32 ``[N]``: what to add to the uint8 accumulator to get ``sum (x - zp) * w``."""
    return (-(int(input_zero_point) + 128) * row_sums(weight)).to(torch.int32)


def packed_depth(packed: torch.Tensor) -> int:
    """Kp, the padded reduction length of a packed weight."""
    return int(packed.shape[1]) * 4
