"""GEMM-based int8 ops: linear, conv1d/conv2d, matmul of two activations."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.loader import F32, I64, INT, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.native.registry import inverse, op
from quantree.backends.cpu.ops.conv1d import (
    conv1d_strided,
    empty_output,
    reads_in_place,
    stages_in_bounds,
)

SIGNATURES: dict[str, list[type]] = {
    "qt_linear": [PTR, I64, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, F32, F32,
                  INT],
    "qt_conv2d": [PTR, *[I64] * 17, PTR, PTR, PTR, PTR, PTR, PTR, F32, F32, INT],
    "qt_conv2d_grouped": [PTR, *[I64] * 18, *[PTR] * 6, F32, F32, INT],
    "qt_conv2d_depthwise": [PTR, *[I64] * 15, *[PTR] * 6, F32, F32, INT],
    "qt_matmul": [PTR, PTR, I64, I64, I64, I64, F32, F32, F32, PTR, PTR, F32, F32],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


@op(
    "linear(Tensor x, Tensor weight, Tensor offset, Tensor scale, Tensor? bias, "
    "int out_features, float out_scale, int out_zero_point, bool relu) -> Tensor"
)
def linear(
    x: Tensor,
    weight: Tensor,
    offset: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_features: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
) -> Tensor:
    """int8 ``x[..., K]`` times a packed weight; int8 out (``out_scale > 0``) or float."""
    check.linear(x, weight, offset, scale, bias, out_features)
    held = NativeArgs("linear")  # alive through the call below
    pointers = held.layer(weight, offset, scale, bias)
    return run_linear(x, packed_depth(weight), pointers, offset, scale, bias, out_features,
                      out_scale, out_zero_point, relu)  # fmt: skip


def run_linear(x: Tensor, kp: int, pointers: tuple[int | None, ...], offset: Tensor,
               scale: Tensor, bias: Tensor | None, out_features: int, out_scale: float,
               out_zero_point: int, relu: bool) -> Tensor:  # fmt: skip
    """``linear`` once its arguments passed ``check.linear``: the constants as ``kp`` and the
    data pointers of weight, offset, scale and bias (a bound call keeps them from the check,
    ``bound_calls.py``)."""
    if x.shape[-1] == 0:  # K = 0: no product to run (some paths size their panels by K)
        shape = (*x.shape[:-1], out_features)
        return _requantized(offset.float() * scale, bias, out_scale, out_zero_point, relu, shape)
    plan = linear_plan(x.shape, kp, pointers, out_features, out_scale, out_zero_point, relu)
    return run_linear_plan(x, plan)


LinearPlan = tuple[int, tuple[int, ...], torch.dtype, Any, tuple[Any, ...], tuple[Any, ...], bool]


def linear_plan(x_shape: torch.Size, kp: int, pointers: tuple[int | None, ...],
                out_features: int, out_scale: float, out_zero_point: int,
                relu: bool) -> LinearPlan:  # fmt: skip
    """A ``linear`` call on an input of ``x_shape`` (K > 0) but the pointers of input and
    output: (rows, output shape, dtype, entry point, arguments before the output pointers,
    after them, int8 output?); kept per input shape by a bound node, as ``conv2d_plan``."""
    rows, k = math.prod(x_shape[:-1]), x_shape[-1]
    quantized = out_scale > 0
    head = (rows, k, out_features, kp, *pointers)
    tail = (inverse(out_scale), float(out_zero_point), int(relu))
    dtype = torch.int8 if quantized else torch.float32
    return rows, (*x_shape[:-1], out_features), dtype, kernels().qt_linear, head, tail, quantized


def run_linear_plan(x: Tensor, plan: LinearPlan) -> Tensor:
    """The kernel call ``plan`` describes, on ``x`` (of the shape it was made for)."""
    rows, shape, dtype, fn, head, tail, quantized = plan
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty(shape, dtype=dtype)
    at = out.data_ptr()  # fresh and dense: no check needed
    fn(ptr(x2), *head, *((at, None) if quantized else (None, at)), *tail)
    return out


def _requantized(
    row: Tensor,
    bias: Tensor | None,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    shape: tuple[int, ...],
) -> Tensor:
    """A product with K = 0, as the kernels' epilogue writes it: the accumulator is 0, so
    each output column is ``row`` (+ bias), then relu, then the output grid."""
    y = row if bias is None else row + bias.float()
    if relu:
        y = y.clamp_min(0.0)
    if out_scale > 0:
        q = torch.round(y * inverse(out_scale)) + out_zero_point
        y = q.clamp(-128, 127).to(torch.int8)
    return y.expand(shape).contiguous()


@torch.library.register_fake("quantree::linear")
def _(x, weight, offset, scale, bias, out_features, out_scale, out_zero_point, relu):
    dtype = torch.int8 if out_scale > 0 else torch.float32
    return x.new_empty((*x.shape[:-1], out_features), dtype=dtype)


def conv2d_shape(
    x: Tensor, out_channels: int, kernel: list[int], stride: list[int], padding: list[int],
    dilation: list[int],
) -> tuple[int, int, int, int]:  # fmt: skip
    """The NCHW output shape; ``padding`` is ``[top, left]`` or ``[top, left, bottom, right]``."""
    return conv2d_shape_of(x.shape, out_channels, kernel, stride, padding, dilation)


def conv2d_shape_of(
    x_shape: torch.Size | tuple[int, ...], out_channels: int, kernel: list[int],
    stride: list[int], padding: list[int], dilation: list[int],
) -> tuple[int, int, int, int]:  # fmt: skip
    """``conv2d_shape`` of an input of this shape."""
    n, _, h, w = x_shape
    end = padding[2:] or padding
    oh = (h + padding[0] + end[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + padding[1] + end[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    return n, out_channels, oh, ow


def is_depthwise(in_channels: int, out_channels: int, groups: int) -> bool:
    """One input and one output channel per group: the direct kernel, weight ``[taps, C]``.

    A GEMM per group would fill 1 of its 16 output lanes (far slower than float).
    """
    return groups == in_channels == out_channels


@op(
    "conv2d(Tensor x, Tensor weight, Tensor offset, Tensor scale, Tensor? bias, "
    "int out_channels, int[] kernel, int[] stride, int[] padding, int[] dilation, "
    "int x_zero_point, float out_scale, int out_zero_point, bool relu, int groups=1) -> Tensor"
)
def conv2d(
    x: Tensor,
    weight: Tensor,
    offset: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    groups: int = 1,
) -> Tensor:
    """int8 convolution; int8 out (``out_scale > 0``) or float.

    ``padding`` is ``[top, left]``, or ``[top, left, bottom, right]`` when the two sides
    differ (``padding='same'`` with an even kernel). ``weight`` holds each group packed in
    turn, or is ``[taps, C]`` for a depthwise convolution (``is_depthwise``). Computed in
    channels-last layout: the result is an NCHW-shaped tensor with channels-last strides,
    which the next convolution reads without a copy.
    """
    check.conv2d(x, weight, offset, scale, bias, out_channels, kernel, stride, padding,
                 dilation, x_zero_point, groups)  # fmt: skip
    held = NativeArgs("conv2d")  # alive through the call below
    pointers = held.layer(weight, offset, scale, bias)
    depthwise = is_depthwise(int(x.shape[1]), out_channels, groups)
    return run_conv2d(x, 0 if depthwise else packed_depth(weight), pointers, out_channels,
                      kernel, stride, padding, dilation, x_zero_point, out_scale,
                      out_zero_point, relu, groups)  # fmt: skip


def run_conv2d(x: Tensor, kp: int, pointers: tuple[int | None, ...], out_channels: int,
               kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
               x_zero_point: int, out_scale: float, out_zero_point: int, relu: bool,
               groups: int = 1) -> Tensor:  # fmt: skip
    """``conv2d`` once its arguments passed ``check.conv2d``: the weight as ``kp`` (0 for the
    depthwise kernel) and the data pointers of weight, offset, scale and bias."""
    plan = conv2d_plan(x.shape, kp, pointers, out_channels, kernel, stride, padding, dilation,
                       x_zero_point, out_scale, out_zero_point, relu, groups)  # fmt: skip
    return run_conv2d_plan(x, plan)


Conv2dPlan = tuple[tuple[int, ...], torch.dtype, Any, tuple[Any, ...], tuple[Any, ...], bool]


def conv2d_plan(x_shape: torch.Size, kp: int, pointers: tuple[int | None, ...],
                out_channels: int, kernel: list[int], stride: list[int], padding: list[int],
                dilation: list[int], x_zero_point: int, out_scale: float, out_zero_point: int,
                relu: bool, groups: int = 1) -> Conv2dPlan:  # fmt: skip
    """Everything a ``conv2d`` call passes its kernel but the input's and output's pointers,
    for an input of ``x_shape``: (output shape, dtype, entry point, the arguments before the
    output pointers, those after, int8 output?). A bound node keeps one per input shape
    (``bound_calls.BoundConv2d``): at batch 1 the per-call Python that derives these (shape
    arithmetic, a 28-argument tuple) cost as much as a small layer's arithmetic."""
    n, c, h, w = x_shape
    shape = conv2d_shape_of(x_shape, out_channels, kernel, stride, padding, dilation)
    quantized = out_scale > 0
    tail = (inverse(out_scale), float(out_zero_point), int(relu))
    if is_depthwise(c, out_channels, groups):
        fn = kernels().qt_conv2d_depthwise
        head = (n, c, h, w, x_zero_point, *kernel, *stride, *padding[:2], *dilation, shape[2],
                shape[3], *pointers)  # fmt: skip
    else:
        fn = kernels().qt_conv2d_grouped
        head = (n, c, h, w, x_zero_point, out_channels, groups, *kernel, *stride, *padding[:2],
                *dilation, shape[2], shape[3], kp, *pointers)  # fmt: skip
    return shape, torch.int8 if quantized else torch.float32, fn, head, tail, quantized


def run_conv2d_plan(x: Tensor, plan: Conv2dPlan) -> Tensor:
    """The kernel call ``plan`` describes, on ``x`` (of the shape it was made for)."""
    shape, dtype, fn, head, tail, quantized = plan
    x = x.contiguous(memory_format=torch.channels_last)
    out = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)
    at = out.data_ptr()  # fresh and dense: no check needed
    fn(ptr(x), *head, *((at, None) if quantized else (None, at)), *tail)
    return out


@torch.library.register_fake("quantree::conv2d")
def _(x, weight, offset, scale, bias, out_channels, kernel, stride, padding, dilation,
      x_zero_point, out_scale, out_zero_point, relu, groups=1):  # fmt: skip
    dtype = torch.int8 if out_scale > 0 else torch.float32
    shape = conv2d_shape(x, out_channels, kernel, stride, padding, dilation)
    return torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)


def as_conv2d_geometry(
    kernel: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """A 1-d convolution's geometry as that of a conv2d of height 1."""
    end = padding[1:] or padding
    return [1, *kernel], [1, *stride], [0, padding[0], 0, end[0]], [1, *dilation]


@op(
    "conv1d(Tensor x, Tensor weight, Tensor offset, Tensor scale, Tensor? bias, "
    "int out_channels, int[] kernel, int[] stride, int[] padding, int[] dilation, "
    "int x_zero_point, float out_scale, int out_zero_point, bool relu, int groups=1) -> Tensor"
)
def conv1d(
    x: Tensor,
    weight: Tensor,
    offset: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
    groups: int = 1,
) -> Tensor:
    """int8 ``[N, C, L]`` convolution; ``padding`` is ``[left]`` or ``[left, right]``.

    A float result is contiguous (``ops/conv1d.py``: the input read in its own layout, no
    copies before or after the float op that reads it). An int8 result has the channels
    innermost (conv2d's channels-last strides), so a following conv1d reads it without a
    copy; an input in that layout runs as the conv2d of ``[N, C, 1, L]``.
    """
    check.conv1d(kernel, stride, padding, dilation)
    quantized = out_scale > 0
    if reads_in_place(x, quantized) and stages_in_bounds(x, kernel, stride, padding, dilation):
        return conv1d_strided(x, weight, offset, scale, bias, out_channels, kernel, stride,
                              padding, dilation, x_zero_point, out_scale, out_zero_point, relu,
                              groups)  # fmt: skip
    geometry = as_conv2d_geometry(kernel, stride, padding, dilation)
    out = conv2d(
        x.unsqueeze(2), weight, offset, scale, bias, out_channels, *geometry,
        x_zero_point, out_scale, out_zero_point, relu, groups,
    )  # fmt: skip
    # a float result is contiguous whichever route ran (what the fake says)
    return out.squeeze(2) if quantized else out.squeeze(2).contiguous()


@torch.library.register_fake("quantree::conv1d")
def _(x, weight, offset, scale, bias, out_channels, kernel, stride, padding, dilation,
      x_zero_point, out_scale, out_zero_point, relu, groups=1):  # fmt: skip
    return empty_output(x, out_channels, kernel, stride, padding, dilation, out_scale > 0)


@op(
    "matmul(Tensor a, Tensor b, float a_scale, int a_zero_point, float b_scale, "
    "int b_zero_point, float out_scale, int out_zero_point) -> Tensor"
)
def matmul(
    a: Tensor,
    b: Tensor,
    a_scale: float,
    a_zero_point: int,
    b_scale: float,
    b_zero_point: int,
    out_scale: float,
    out_zero_point: int,
) -> Tensor:
    """int8 ``a @ b`` (batch dimensions broadcast); int8 out (``out_scale > 0``) or float."""
    check.matmul(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    count = math.prod(batch)  # not -1: m, k or n may be 0
    a3 = a.expand(*batch, m, k).reshape(count, m, k).contiguous()
    b3 = b.expand(*batch, k, n).reshape(count, k, n).contiguous()
    quantized = out_scale > 0
    if k == 0:  # an empty sum: every product is 0 (some paths size their panels by K)
        return _requantized(torch.zeros(n), None, out_scale, out_zero_point, False, (*batch, m, n))
    out = torch.empty((*batch, m, n), dtype=torch.int8 if quantized else torch.float32)
    kernels().qt_matmul(
        ptr(a3), ptr(b3), a3.shape[0], m, k, n, float(a_zero_point), float(b_zero_point),
        a_scale * b_scale, ptr(out) if quantized else None, None if quantized else ptr(out),
        inverse(out_scale), float(out_zero_point),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::matmul")
def _(a, b, a_scale, a_zero_point, b_scale, b_zero_point, out_scale, out_zero_point):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    dtype = torch.int8 if out_scale > 0 else torch.float32
    return torch.empty((*batch, a.shape[-2], b.shape[-1]), dtype=dtype)
