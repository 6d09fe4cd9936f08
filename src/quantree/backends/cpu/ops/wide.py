"""Layers with weights reading int16 activations (w8a16), on the int8 kernels.

An int16 input ``q`` is two int8 tensors, ``hi = q >> 8`` on zero point 0 and
``lo = (q & 255) - 128`` on zero point -128 (``q = 256 * hi + lo + 128``). A linear or
convolution is linear in its input, so its 16-bit product is the sum of the int8 kernel's
products of the two planes: the hi plane's on the input scale times 256, the lo plane's on
the input scale. Each plane's sum is an int32 like any int8 product's (no overflow a 16-bit
accumulation would risk) and the two are joined in float, as the reference's float
product of the dequantized values is. No new GEMM: a linear runs the GEMM's dual pass (both
planes on one read of the weight, as the recurrent kernels' int16 hidden state does), every
convolution form (grouped, depthwise, 1-d) runs its int8 kernel once per plane (the low
plane's carrying the int32 bias, on exactly its grid), on every kernel path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.loader import F32, I64, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.native.registry import op
from quantree.backends.cpu.ops.conv1d import (
    conv1d_strided,
    conv16_small,
    stages_in_bounds,
    takes_small,
)
from quantree.backends.cpu.ops.elementwise import dense_any_layout, in_memory_order
from quantree.backends.cpu.ops.gemm import as_conv2d_geometry, conv2d

SIGNATURES: dict[str, list[type]] = {
    "qt_quantize16": [PTR, I64, F32, PTR],
    "qt_split16": [PTR, I64, F32, F32, F32, PTR, PTR],
    "qt_linear16": [PTR, *[I64] * 4, *[PTR] * 5, F32, F32, F32],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

LO_ZERO_POINT = -128
"""The zero point of the low byte plane: ``lo + 128`` is the byte ``q & 255``."""


def split16(x: Tensor, scale: float, quant_min: int, quant_max: int) -> tuple[Tensor, Tensor]:
    """The reference's symmetric int16 quantize of float ``x``, as its (hi, lo) int8 planes,
    in ``x``'s memory order (a channels-last ``x`` gives channels-last planes)."""
    check.positive("split16", "scale", scale)
    x = dense_any_layout(x.float())
    hi, lo = torch.empty_like(x, dtype=torch.int8), torch.empty_like(x, dtype=torch.int8)
    kernels().qt_split16(
        ptr(in_memory_order(x)), x.numel(), 1.0 / scale, float(quant_min), float(quant_max),
        ptr(in_memory_order(hi)), ptr(in_memory_order(lo)),
    )  # fmt: skip
    return hi, lo


@op(
    "linear16(Tensor x, float x_scale, int quant_min, int quant_max, Tensor weight, "
    "Tensor offset, Tensor scale, Tensor? bias, int out_features) -> Tensor"
)
def linear16(
    x: Tensor,
    x_scale: float,
    quant_min: int,
    quant_max: int,
    weight: Tensor,
    offset: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_features: int,
) -> Tensor:
    """Float ``x[..., K]`` quantized to int16 (``x_scale``, zero point 0) times a packed int8
    weight: the float result of ``linear(dq16(q16(x)), dq(W), dq(b))``. The GEMM's dual pass
    multiplies both planes on one read of the weight (``offset``: the hi plane's, for zero
    point 0; ``scale``: input scale x weight scale; ``bias`` float)."""
    check.linear16(x, weight, offset, scale, bias, out_features)
    check.positive("linear16", "x_scale", x_scale)
    held = NativeArgs("linear16")  # alive through the call below
    pointers = held.layer(weight, offset, scale, bias)
    return run_linear16(x, x_scale, quant_min, quant_max, packed_depth(weight), pointers,
                        out_features)  # fmt: skip


def run_linear16(x: Tensor, x_scale: float, quant_min: int, quant_max: int, kp: int,
                 pointers: tuple[int | None, ...], out_features: int) -> Tensor:  # fmt: skip
    """``linear16`` once its arguments passed ``check.linear16``: the weight as ``kp`` and the
    data pointers of weight, offset, scale and bias."""
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
    kernels().qt_linear16(
        ptr(x2), x2.shape[0], x2.shape[1], out_features, kp, *pointers, ptr(out),
        1.0 / x_scale, float(quant_min), float(quant_max),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::linear16")
def _(x, x_scale, quant_min, quant_max, weight, offset, scale, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


@op(
    "conv16(Tensor x, float x_scale, int quant_min, int quant_max, Tensor weight, "
    "Tensor hi_offset, Tensor hi_scale, Tensor lo_offset, Tensor lo_scale, Tensor? bias, "
    "int out_channels, int[] kernel, int[] stride, int[] padding, int[] dilation, "
    "int groups) -> Tensor"
)
def conv16(
    x: Tensor,
    x_scale: float,
    quant_min: int,
    quant_max: int,
    weight: Tensor,
    hi_offset: Tensor,
    hi_scale: Tensor,
    lo_offset: Tensor,
    lo_scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> Tensor:
    """Float ``x`` (``[N, C, L]`` or ``[N, C, H, W]``) quantized to int16, convolved with a
    packed int8 weight as ``quantree.conv1d``/``conv2d`` would (padding reads the zero point
    of each plane, so 0 of the 16-bit value): float out, contiguous for ``[N, C, L]``
    (``ops/conv1d.py``: quantized panel by panel as it lies, no copy of the tensor), else with
    channels-last strides."""
    one_d = x.dim() == 3
    if one_d:
        check.conv1d(kernel, stride, padding, dilation)
    if one_d and stages_in_bounds(x, kernel, stride, padding, dilation):
        wide = (x_scale, quant_min, quant_max, lo_offset, lo_scale)
        if takes_small(int(x.shape[1]), out_channels, kernel, groups):
            return conv16_small(x, wide, weight, hi_offset, hi_scale, bias, out_channels, kernel,
                                stride, padding, dilation)  # fmt: skip
        return conv1d_strided(x, weight, hi_offset, hi_scale, bias, out_channels, kernel, stride,
                              padding, dilation, 0, 0.0, 0, False, groups, wide)  # fmt: skip
    shape = (out_channels, *(as_conv2d_geometry(kernel, stride, padding, dilation) if one_d
                             else (kernel, stride, padding, dilation)))  # fmt: skip
    # channels-last before the split: the planes are then what the kernels read, no copies
    x4 = (x.unsqueeze(2) if one_d else x).contiguous(memory_format=torch.channels_last)
    hi, lo = split16(x4, x_scale, quant_min, quant_max)
    out = conv2d(hi, weight, hi_offset, hi_scale, None, *shape, 0, 0.0, 0, False, groups)
    low = conv2d(lo, weight, lo_offset, lo_scale, bias, *shape, LO_ZERO_POINT, 0.0, 0, False,
                 groups)  # fmt: skip
    out.add_(low)
    return out.squeeze(2).contiguous() if one_d else out  # a 1-d result is contiguous


@torch.library.register_fake("quantree::conv16")
def _(x, x_scale, quant_min, quant_max, weight, hi_offset, hi_scale, lo_offset, lo_scale, bias,
      out_channels, kernel, stride, padding, dilation, groups):  # fmt: skip
    conv = torch.ops.quantree.conv1d if x.dim() == 3 else torch.ops.quantree.conv2d
    like = x.new_empty(x.shape, dtype=torch.int8)
    return conv(like, weight, hi_offset, hi_scale, bias, out_channels, kernel, stride, padding,
                dilation, 0, 0.0, 0, False, groups)  # fmt: skip
