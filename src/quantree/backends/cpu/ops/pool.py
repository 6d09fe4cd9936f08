"""int8 max and average pooling on channels-last tensors (what the native convolutions
produce)."""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import library, ptr
from quantree.backends.cpu.native.registry import inverse, op


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
    library().qt_max_pool2d(
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
    library().qt_avg_pool2d(
        ptr(x), n, c, h, w, *kernel, *stride, *padding, shape[2], shape[3],
        int(count_include_pad), int(divisor_override), float(x_scale), int(x_zero_point),
        inverse(out_scale), float(out_zero_point), ptr(out),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::avg_pool2d")
def _avg_pool2d_fake(x, kernel, stride, padding, ceil_mode, *_):
    shape = pool_shape(x, kernel, stride, padding, [1, 1], ceil_mode)
    return torch.empty(shape, dtype=torch.int8, memory_format=torch.channels_last)
