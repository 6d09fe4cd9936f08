"""int8 cumulative sum along one dimension onto an int8 grid (``csrc/cumsum.cpp``).

A quantizer that quantizes ``cumsum`` on both sides (the default recipe leaves it float)
would otherwise leave a float island on the CPU: the int8 input dequantized to a float copy,
summed, every total quantized. Here the codes are summed in int32 and only the totals are
converted. Added by following ``docs/adding-an-op.md``: this file, the kernel, the rule
(``rules/cumsum.py``), and an entry each in ``OPS`` and the rule tuple.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from quantree.backends.cpu.native.checks import I8, LIMIT, dtype_of, fail
from quantree.backends.cpu.native.loader import F32, I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import inverse, op

SIGNATURES: dict[str, list[type]] = {
    "qt_cumsum": [PTR, I64, I64, I64, F32, I64, F32, F32, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)
MAX_SUMMED = 1 << 23
"""Codes summed into one int32 total at most: 255 of them each cannot overflow it."""


# void qt_cumsum(const int8_t* x, int64_t outer, int64_t K, int64_t inner, float x_scale,
#                int64_t x_zp, float inv, float zp, int8_t* out)
def check_cumsum(x: Tensor, dim: int, x_zero_point: int, out_zero_point: int) -> None:
    """x int8 on the CPU with at least one dimension, ``dim`` one of them, below
    ``MAX_SUMMED`` codes along it and ``LIMIT`` in all; int8 zero points."""
    name = "cumsum"
    dtype_of(name, "x", x, I8)
    if not x.is_cpu or x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise fail(name, f"x of shape {tuple(x.shape)} on {x.device} has no dimension {dim}")
    if x.shape[dim] >= MAX_SUMMED or x.numel() >= LIMIT:
        raise fail(name, f"x of shape {tuple(x.shape)}: the kernel sums below 2**23 codes "
                   "into one total, below 2**31 in all")  # fmt: skip
    if not (-128 <= x_zero_point <= 127 and -128 <= out_zero_point <= 127):
        raise fail(name, f"zero points {x_zero_point}, {out_zero_point} are not int8 values")


@op(
    "cumsum(Tensor x, int dim, float x_scale, int x_zero_point, float out_scale, "
    "int out_zero_point) -> Tensor"
)
def cumsum(
    x: Tensor, dim: int, x_scale: float, x_zero_point: int, out_scale: float, out_zero_point: int
) -> Tensor:
    """int8 ``x``'s running totals along ``dim``, each on the output grid."""
    check_cumsum(x, dim, x_zero_point, out_zero_point)
    d = dim % x.dim()
    x = x.contiguous()
    outer, k, inner = math.prod(x.shape[:d]), x.shape[d], math.prod(x.shape[d + 1 :])
    out = torch.empty(x.shape, dtype=torch.int8)
    kernels().qt_cumsum(
        x.data_ptr(), outer, k, inner, float(x_scale), int(x_zero_point), inverse(out_scale),
        float(out_zero_point), out.data_ptr(),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::cumsum")
def _(x, dim, x_scale, x_zero_point, out_scale, out_zero_point):
    return x.new_empty(x.shape, dtype=torch.int8)
