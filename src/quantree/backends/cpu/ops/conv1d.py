"""1-d convolutions that read and write ``[N, C, L]`` as it lies in memory (``csrc/conv1d.cpp``).

torch has no 3-d channels-last memory format, so the conv2d-of-height-1 route left a float
op after every convolution (group norm, PReLU, GELU: each 1-d model under
``WEIGHTED_INPUTS``) copying the channels-last result back, and the next convolution
copying its input to channels-last again: ConvTasNet spent most of its lowered time in
``copy_`` and ran slower than float. This kernel reads the input through its strides and writes a
float result contiguous, transposing panel by panel in cache, with conv2d's arithmetic (the
results are equal bit for bit). An int8 result keeps the channels-last strides: what reads
it is the next int8 layer, which reads that layout without a copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, INT, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.native.registry import inverse

SIGNATURES: dict[str, list[type]] = {
    "qt_conv1d": [PTR, PTR, *[I64] * 7, F32, F32, F32, *[I64] * 8, *[PTR] * 8,
                  *[I64] * 3, F32, F32, INT],
    "qt_conv1d16_small": [PTR, *[I64] * 6, F32, F32, F32, *[I64] * 7, *[PTR] * 7, *[I64] * 3],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

Wide = tuple[float, int, int, Tensor, Tensor]
"""A float input quantized to int16 inside: (scale, quant_min, quant_max, and the low
plane's offset and scale; the ``offset``/``scale`` arguments are then the high plane's)."""


def output_length(length: int, kernel: int, stride: int, padding: list[int], dilation: int) -> int:
    """Output positions; ``padding`` is ``[left]`` or ``[left, right]``."""
    right = padding[-1]
    return (length + padding[0] + right - dilation * (kernel - 1) - 1) // stride + 1


def empty_output(
    x: Tensor, out_channels: int, kernel: list[int], stride: list[int], padding: list[int],
    dilation: list[int], quantized: bool,
) -> Tensor:  # fmt: skip
    """The result: float contiguous ``[N, O, L']``, int8 with the channels innermost."""
    n, _, length = x.shape
    ol = output_length(length, kernel[0], stride[0], padding, dilation[0])
    if quantized:
        return x.new_empty((n, ol, out_channels), dtype=torch.int8).transpose(1, 2)
    return x.new_empty((n, out_channels, ol), dtype=torch.float32)


PANEL = 256
"""Most output positions the kernel computes at once (its panels)."""


def stages_in_bounds(x: Tensor, kernel: list[int], stride: list[int], padding: list[int],
                     dilation: list[int]) -> bool:  # fmt: skip
    """Whether a panel's staged input span (what the kernel allocates per channel) stays
    within a few input lengths. Only a geometry reaching far beyond its input (a stride or
    dilation larger than the input, padded to fit) exceeds it: such a call runs as the
    conv2d of height 1, whose buffers do not grow with the span."""
    length = x.shape[2]
    out = output_length(length, kernel[0], stride[0], padding, dilation[0])
    span = (min(PANEL, max(out, 1)) - 1) * stride[0] + (kernel[0] - 1) * dilation[0] + 1
    return span <= 4 * length + 4096


def reads_in_place(x: Tensor, quantized: bool) -> bool:
    """Whether this kernel takes the call by layout: always for a float result; for an int8
    result unless ``x`` is already channels-last (conv2d's own layout, which an int8 chain
    of convolutions keeps without a copy)."""
    if not quantized:
        return True
    return x.is_contiguous() or not x.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)


def conv1d_strided(
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
    groups: int,
    wide: Wide | None = None,
) -> Tensor:
    """int8 ``x`` (or float with ``wide``) ``[N, C, L]`` of any strides, convolved with a
    weight packed as ``quantree.conv1d``'s; int8 out (``out_scale > 0``) or float."""
    lo_offset, lo_scale = (wide[3], wide[4]) if wide is not None else (None, None)
    if wide is not None and x.dtype != torch.float32:
        x = x.float()
    check.conv1d_strided(x, wide is not None, weight, offset, scale, lo_offset, lo_scale, bias,
                         out_channels, kernel, stride, padding, dilation, x_zero_point,
                         groups)  # fmt: skip
    quantized = out_scale > 0
    out = empty_output(x, out_channels, kernel, stride, padding, dilation, quantized)
    n, c, length = x.shape
    x_scale, qmin, qmax = (wide[0], wide[1], wide[2]) if wide is not None else (1.0, 0, 0)
    depth = 0 if groups == c == out_channels else packed_depth(weight)
    kernels().qt_conv1d(
        None if wide else x.data_ptr(), x.data_ptr() if wide else None, *x.stride(), n, c,
        length, x_zero_point, 1.0 / x_scale, float(qmin), float(qmax), out_channels, groups,
        kernel[0], stride[0], padding[0], dilation[0], out.shape[2], depth, ptr(weight),
        ptr(offset), ptr(scale), ptr(lo_offset), ptr(lo_scale), ptr(bias),
        out.data_ptr() if quantized else None, None if quantized else out.data_ptr(),
        *out.stride(), inverse(out_scale), float(out_zero_point), int(relu),
    )  # fmt: skip
    return out


SMALL_PRODUCT = 256
"""Most multiply-adds per output position (``C * K * OC``) of a conv16 the tap-by-tap kernel
(``csrc/conv1d_small.cpp``) takes; larger products fill the GEMM's lanes and run there."""


def takes_small(c: int, out_channels: int, kernel: list[int], groups: int) -> bool:
    """Whether an int16-input 1-d convolution is summed tap by tap: groups 1 (depthwise and
    grouped layers have their own kernels) and a product small enough that the GEMM route's
    staging and per-panel set-up cost more than the sums."""
    return groups == 1 and c * kernel[0] * out_channels <= SMALL_PRODUCT


def conv16_small(
    x: Tensor,
    wide: Wide,
    weight: Tensor,
    offset: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> Tensor:
    """``conv1d_strided``'s wide call (groups 1, float out) on the tap-by-tap kernel: equal to
    it bit for bit (``csrc/conv1d_small.cpp``)."""
    x_scale, qmin, qmax, lo_offset, lo_scale = wide
    if x.dtype != torch.float32:
        x = x.float()
    check.conv1d_strided(x, True, weight, offset, scale, lo_offset, lo_scale, bias,
                         out_channels, kernel, stride, padding, dilation, 0, 1)  # fmt: skip
    pointers = (ptr(weight), ptr(offset), ptr(scale), ptr(lo_offset), ptr(lo_scale), ptr(bias))
    return run_conv16(x, x_scale, qmin, qmax, True, packed_depth(weight), pointers, out_channels,
                      kernel, stride, padding, dilation, 1)  # fmt: skip


def run_conv16(
    x: Tensor, x_scale: float, qmin: int, qmax: int, small: bool, depth: int,
    pointers: tuple[int | None, ...], out_channels: int, kernel: list[int], stride: list[int],
    padding: list[int], dilation: list[int], groups: int,
) -> Tensor:  # fmt: skip
    """A float ``[N, C, L]`` conv16 whose arguments passed ``check.conv1d_strided`` (wide) and
    ``stages_in_bounds``: tap by tap (``small``, ``takes_small``) or the GEMM route, with the
    addresses of weight, offset, scale, lo_offset, lo_scale and bias, and the weight's packed
    ``depth`` (0 for a depthwise one). The op and its per-node binding both end here."""
    out = empty_output(x, out_channels, kernel, stride, padding, dilation, False)
    n, c, length = x.shape
    if small:
        kernels().qt_conv1d16_small(
            x.data_ptr(), *x.stride(), n, c, length, 1.0 / x_scale, float(qmin), float(qmax),
            out_channels, kernel[0], stride[0], padding[0], dilation[0], out.shape[2], depth,
            *pointers, out.data_ptr(), *out.stride(),
        )  # fmt: skip
        return out
    kernels().qt_conv1d(
        None, x.data_ptr(), *x.stride(), n, c, length, 0, 1.0 / x_scale, float(qmin),
        float(qmax), out_channels, groups, kernel[0], stride[0], padding[0], dilation[0],
        out.shape[2], depth, *pointers, None, out.data_ptr(), *out.stride(), 0.0, 0.0, 0,
    )  # fmt: skip
    return out
