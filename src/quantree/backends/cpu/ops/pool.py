"""int8 max and average pooling on channels-last tensors (what the native convolutions
produce), and global average pooling (``csrc/mean.cpp``).

Squeeze-excite blocks (EfficientNet, RegNet-Y, MobileNetV3) and classifier heads average a
whole feature map into C values. Without a kernel that was a float island: the int8 map
dequantized to a float copy, averaged, the C results quantized. ``mean_hw`` sums the codes
in int32 in one pass over the map as it lies (channels-last from a convolution, or
contiguous), and only the C sums are converted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import inverse, op

SIGNATURES: dict[str, list[type]] = {
    "qt_max_pool2d": [PTR, *[I64] * 14, PTR],
    "qt_avg_pool2d": [PTR, *[I64] * 14, F32, I64, F32, F32, PTR],
    "qt_mean_hw": [PTR, *[I64] * 8, F32, I64, F32, F32, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


def pool_shape(
    x: Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
    ceil_mode: bool,
) -> tuple[int, int, int, int]:  # fmt: skip
    """The NCHW output shape, by ATen's rule (a ceil-mode window must start inside the input
    or its left padding)."""
    n, c, h, w = x.shape
    sizes = []
    for size, k, s, p, d in zip((h, w), kernel, stride, padding, dilation, strict=True):
        span = size + 2 * p - d * (k - 1) - 1
        out = (span + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        sizes.append(out)
    return n, c, sizes[0], sizes[1]


@op(
    "max_pool2d(Tensor x, int[] kernel, int[] stride, int[] padding, int[] dilation, "
    "bool ceil_mode) -> Tensor"
)
def max_pool2d(
    x: Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
    ceil_mode: bool,
) -> Tensor:  # fmt: skip
    """Max pooling of int8 values; the result is channels-last like the input it expects."""
    check.max_pool2d(x, kernel, stride, padding, dilation)
    return run_max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)


def run_max_pool2d(
    x: Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
    ceil_mode: bool,
) -> Tensor:  # fmt: skip
    """``max_pool2d`` once its arguments passed ``check.max_pool2d``."""
    x = x.contiguous(memory_format=torch.channels_last)
    shape = pool_shape(x, kernel, stride, padding, dilation, ceil_mode)
    out = torch.empty(shape, dtype=torch.int8, memory_format=torch.channels_last)
    n, c, h, w = x.shape
    kernels().qt_max_pool2d(
        ptr(x), n, c, h, w, *kernel, *stride, *padding, *dilation, shape[2], shape[3], ptr(out)
    )
    return out


@torch.library.register_fake("quantree::max_pool2d")
def _(x, kernel, stride, padding, dilation, ceil_mode):
    shape = pool_shape(x, kernel, stride, padding, dilation, ceil_mode)
    return torch.empty(shape, dtype=torch.int8, memory_format=torch.channels_last)


@op(
    "avg_pool2d(Tensor x, int[] kernel, int[] stride, int[] padding, bool ceil_mode, "
    "bool count_include_pad, int divisor_override, float x_scale, int x_zero_point, "
    "float out_scale, int out_zero_point) -> Tensor"
)
def avg_pool2d(
    x: Tensor, kernel: list[int], stride: list[int], padding: list[int], ceil_mode: bool,
    count_include_pad: bool, divisor_override: int, x_scale: float, x_zero_point: int,
    out_scale: float, out_zero_point: int,
) -> Tensor:  # fmt: skip
    """ATen's ``avg_pool2d`` from one int8 grid onto another (``divisor_override`` 0: none);
    the result is channels-last like the input it expects."""
    check.avg_pool2d(x, kernel, stride, padding, divisor_override, x_zero_point, out_zero_point)
    x = x.contiguous(memory_format=torch.channels_last)
    shape = pool_shape(x, kernel, stride, padding, [1, 1], ceil_mode)
    out = torch.empty(shape, dtype=torch.int8, memory_format=torch.channels_last)
    n, c, h, w = x.shape
    kernels().qt_avg_pool2d(
        ptr(x), n, c, h, w, *kernel, *stride, *padding, shape[2], shape[3],
        int(count_include_pad), int(divisor_override), float(x_scale), int(x_zero_point),
        inverse(out_scale), float(out_zero_point), ptr(out),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::avg_pool2d")
def _avg_pool2d_fake(x, kernel, stride, padding, ceil_mode, *_):
    shape = pool_shape(x, kernel, stride, padding, [1, 1], ceil_mode)
    return torch.empty(shape, dtype=torch.int8, memory_format=torch.channels_last)


@op(
    "mean_hw(Tensor x, float x_scale, int x_zero_point, float out_scale, int out_zero_point, "
    "bool keepdim) -> Tensor"
)
def mean_hw(
    x: Tensor,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    keepdim: bool,
) -> Tensor:
    """int8 ``x`` ``[N, C, H, W]`` averaged over H and W onto the output grid: ``[N, C, 1, 1]``
    (``keepdim``) or ``[N, C]``."""
    check.mean_hw(x, x_zero_point, out_zero_point)
    n, c, h, w = x.shape
    out = torch.empty((n, c), dtype=torch.int8)
    kernels().qt_mean_hw(
        x.data_ptr(), n, c, h, w, *x.stride(), float(x_scale), int(x_zero_point),
        inverse(out_scale), float(out_zero_point), out.data_ptr(),
    )  # fmt: skip
    return out.view(n, c, 1, 1) if keepdim else out


@torch.library.register_fake("quantree::mean_hw")
def _(x, x_scale, x_zero_point, out_scale, out_zero_point, keepdim):
    shape = (x.shape[0], x.shape[1], 1, 1) if keepdim else (x.shape[0], x.shape[1])
    return x.new_empty(shape, dtype=torch.int8)
