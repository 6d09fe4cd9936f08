"""int8 per-channel affine map (``csrc/channel_affine.cpp``): a batch norm between two int8
grids that no convolution or linear absorbed.

Pre-activation networks (DenseNet: norm -> relu -> conv on a concatenation) normalise
before their convolutions, so there is nothing to fold the norm into; it ran as a float
island (the int8 map dequantized, normalised, quantized again). Here one pass maps every
code, in the input's own layout (channels-last from a convolution, or contiguous), and the
output keeps that layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import inverse, op

SIGNATURES: dict[str, list[type]] = {
    "qt_channel_affine": [PTR, *[I64] * 3, F32, F32, PTR, PTR, F32, F32, F32, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


@op(
    "channel_affine(Tensor x, float x_scale, int x_zero_point, Tensor alpha, Tensor beta, "
    "float out_scale, int out_zero_point, bool relu) -> Tensor"
)
def channel_affine(
    x: Tensor,
    x_scale: float,
    x_zero_point: int,
    alpha: Tensor,
    beta: Tensor,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
) -> Tensor:
    """int8 ``x`` ``[N, C, ...]`` mapped per channel (dim 1) as ``dq(x) * alpha + beta``
    onto the output grid (clamped at its zero point when ``relu``)."""
    check.channel_affine(x, alpha, beta, x_zero_point, out_zero_point)
    c = int(x.shape[1])
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and c > 1:
        outer, inner = x.shape[0] * x.shape[2] * x.shape[3], 1
        out = torch.empty_like(x, memory_format=torch.channels_last)
    else:
        x = x.contiguous()
        outer, inner = int(x.shape[0]), math.prod(x.shape[2:])
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    qmin = float(max(out_zero_point, -128)) if relu else -128.0
    kernels().qt_channel_affine(
        x.data_ptr(), outer, c, inner, float(x_scale), float(x_zero_point), alpha.data_ptr(),
        beta.data_ptr(), inverse(out_scale), float(out_zero_point), qmin, out.data_ptr(),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::channel_affine")
def _(x, x_scale, x_zero_point, alpha, beta, out_scale, out_zero_point, relu):
    return torch.empty_like(x)
