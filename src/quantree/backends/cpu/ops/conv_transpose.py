"""int8 transposed convolutions, 1-d and 2-d (``csrc/conv_transpose.cpp``).

The kernel multiplies each input pixel's channels by the weight (the shared packed GEMM of
every ISA path) and scatters the products into an exact int32 accumulator at the output
pixels the taps reach, then runs conv's epilogue. Layouts follow the convolutions': a 2-d
result is channels-last (what the next int8 layer reads without a copy); a 1-d float result
is contiguous ``[N, O, L]``, an int8 one has the channels innermost (``ops/conv1d.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, INT, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.packing import pack, zero_point_offset
from quantree.backends.cpu.native.registry import inverse, op

SIGNATURES: dict[str, list[type]] = {
    "qt_conv_transpose": [PTR, *[I64] * 16, *[PTR] * 7, *[I64] * 4, F32, F32, INT],
    "qt_conv_transpose16": [PTR, *[I64] * 8, F32, F32, F32, *[I64] * 12, *[PTR] * 8,
                            *[I64] * 4],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

CHUNK = check.CONV_TRANSPOSE_CHUNK
"""Input channels one GEMM reduces over at most: ``csrc/conv_transpose.cpp`` reads its float
result as an exact integer, which needs ``CHUNK * 255 * 127 < 2**24``."""


def packed_transposed_weight(
    values: Tensor, groups: int, x_zero_point: int
) -> tuple[Tensor, Tensor]:
    """(packed weight, column offsets) of an int8 ``[C, O / groups, *kernel]`` weight.

    Per group, then per chunk of at most ``CHUNK`` input channels: the ``[taps * O / groups,
    chunk]`` matrix with rows ordered (*kernel, output channel), packed on its own, and the
    zero-point correction of each of its rows (the kernel's GEMM reads ``x + 128``).
    """
    cg = values.shape[0] // groups
    weights: list[Tensor] = []
    offsets: list[Tensor] = []
    for part in values.chunk(groups):
        rows = part.permute(*range(2, part.dim()), 1, 0).reshape(-1, cg)
        for k0 in range(0, cg, CHUNK):
            chunk = rows[:, k0 : k0 + CHUNK]
            weights.append(pack(chunk).reshape(-1))
            offsets.append(zero_point_offset(chunk, x_zero_point))
    return torch.cat(weights), torch.cat(offsets)


def output_size(
    size: list[int], kernel: list[int], stride: list[int], padding: list[int],
    output_padding: list[int], dilation: list[int],
) -> list[int]:  # fmt: skip
    """torch's output size: ``(in - 1) * stride - 2 * padding + dilation * (kernel - 1)
    + output_padding + 1``."""
    return [
        (i - 1) * s - 2 * p + d * (k - 1) + op + 1
        for i, k, s, p, op, d in zip(
            size, kernel, stride, padding, output_padding, dilation, strict=True
        )
    ]


def empty_output(x: Tensor, out_channels: int, size: list[int], quantized: bool) -> Tensor:
    """The result in the convolutions' layouts (see the module's docstring)."""
    dtype = torch.int8 if quantized else torch.float32
    n = x.shape[0]
    if len(size) == 2:
        shape = (n, out_channels, *size)
        return torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)
    if quantized:
        return x.new_empty((n, size[0], out_channels), dtype=dtype).transpose(1, 2)
    return x.new_empty((n, out_channels, size[0]), dtype=dtype)


@op(
    "conv_transpose(Tensor x, Tensor weight, Tensor col_offset, Tensor offset, Tensor scale, "
    "Tensor? bias, int out_channels, int[] kernel, int[] stride, int[] padding, "
    "int[] output_padding, int[] dilation, int groups, float out_scale, int out_zero_point, "
    "bool relu) -> Tensor"
)
def conv_transpose(
    x: Tensor,
    weight: Tensor,
    col_offset: Tensor,
    offset: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    output_padding: list[int],
    dilation: list[int],
    groups: int,
    out_scale: float,
    out_zero_point: int,
    relu: bool,
) -> Tensor:
    """int8 ``x`` ``[N, C, L]`` or ``[N, C, H, W]``, transposed-convolved with a weight made
    by ``packed_transposed_weight``; int8 out (``out_scale > 0``) or float. ``offset`` is
    the int32 added per output channel (an exact int32 bias), ``scale`` the accumulator's
    scale, ``bias`` a float bias."""
    check.conv_transpose(x, weight, col_offset, offset, scale, bias, out_channels, kernel,
                         stride, padding, output_padding, dilation, groups)  # fmt: skip
    dims = len(kernel)
    size = output_size(list(x.shape[2:]), kernel, stride, padding, output_padding, dilation)
    quantized = out_scale > 0
    out = empty_output(x, out_channels, size, quantized)
    if dims == 2:
        xl = x.contiguous(memory_format=torch.channels_last)
        geometry = [*xl.shape[2:], *kernel, *stride, *padding, *dilation, *size]
        strides = list(out.stride())
    else:
        xl = x.transpose(1, 2).contiguous()  # [N, L, C]: no copy when already channels-last
        geometry = [
            1,
            x.shape[2],
            1,
            kernel[0],
            1,
            stride[0],
            0,
            padding[0],
            1,
            dilation[0],
            1,
            size[0],
        ]
        strides = [out.stride(0), out.stride(1), 0, out.stride(2)]
    if out.numel() == 0:
        return out
    n, c = x.shape[:2]
    h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = geometry
    kernels().qt_conv_transpose(
        ptr(xl), n, c, h, w, out_channels, groups, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow,
        ptr(weight), ptr(col_offset), ptr(offset), ptr(scale), ptr(bias),
        out.data_ptr() if quantized else None, None if quantized else out.data_ptr(), *strides,
        inverse(out_scale), float(out_zero_point), int(relu),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::conv_transpose")
def _(x, weight, col_offset, offset, scale, bias, out_channels, kernel, stride, padding,
      output_padding, dilation, groups, out_scale, out_zero_point, relu):  # fmt: skip
    size = output_size(list(x.shape[2:]), kernel, stride, padding, output_padding, dilation)
    return empty_output(x, out_channels, size, out_scale > 0)


@op(
    "conv_transpose16(Tensor x, float x_scale, int quant_min, int quant_max, Tensor weight, "
    "Tensor hi_col_offset, Tensor lo_col_offset, Tensor offset, Tensor hi_scale, Tensor scale, "
    "Tensor? bias, int out_channels, int[] kernel, int[] stride, int[] padding, "
    "int[] output_padding, int[] dilation, int groups) -> Tensor"
)
def conv_transpose16(
    x: Tensor,
    x_scale: float,
    quant_min: int,
    quant_max: int,
    weight: Tensor,
    hi_col_offset: Tensor,
    lo_col_offset: Tensor,
    offset: Tensor,
    hi_scale: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    output_padding: list[int],
    dilation: list[int],
    groups: int,
) -> Tensor:
    """Float ``x`` quantized to int16 (``x_scale``, zero point 0), transposed-convolved with
    an int8 weight: the float result of ``conv_transpose(dq16(q16(x)), dq(W), dq(b))``.

    As ``ops/wide.py``'s conv16: the int16 codes as two int8 planes, each summed as the int8
    kernel sums its input, in one native call (the hi plane on ``hi_scale`` = 256 x the
    accumulator's scale, zero point 0; the lo plane on ``scale``, zero point -128, with the
    int32 ``offset`` and the float bias), the two float results added. 2 x the int8 layer's
    work: on ConvTasNet's decoder an int8 input there was the model's largest error
    (benchmarks/README.md, "CNNs against torchao + Inductor").
    """
    # one native call for both planes (``qt_conv_transpose16``): the input is quantized and
    # split panel by panel as it lies, no plane tensors, and the two sums meet in its epilogue
    if x.dtype != torch.float32:
        x = x.float()
    check.conv_transpose(x, weight, hi_col_offset, offset, scale, bias, out_channels, kernel,
                         stride, padding, output_padding, dilation, groups,
                         wide=(lo_col_offset, hi_scale))  # fmt: skip
    check.positive("conv_transpose16", "x_scale", x_scale)
    size = output_size(list(x.shape[2:]), kernel, stride, padding, output_padding, dilation)
    out = empty_output(x, out_channels, size, False)
    if out.numel() == 0:
        return out
    if x.dim() == 3:
        n, c, length = x.shape
        sizes = [1, length, 1, kernel[0], 1, stride[0], 0, padding[0], 1, dilation[0], 1, size[0]]
        x_strides = [x.stride(0), x.stride(1), 0, x.stride(2)]
        strides = [out.stride(0), out.stride(1), 0, out.stride(2)]
    else:
        n, c = x.shape[:2]
        sizes = [*x.shape[2:], *kernel, *stride, *padding, *dilation, *size]
        x_strides, strides = list(x.stride()), list(out.stride())
    h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = sizes
    kernels().qt_conv_transpose16(
        x.data_ptr(), *x_strides, n, c, h, w, 1.0 / x_scale, float(quant_min), float(quant_max),
        out_channels, groups, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, ptr(weight),
        ptr(hi_col_offset), ptr(lo_col_offset), ptr(offset), ptr(hi_scale), ptr(scale), ptr(bias),
        out.data_ptr(), *strides,
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::conv_transpose16")
def _(x, x_scale, quant_min, quant_max, weight, hi_col_offset, lo_col_offset, offset, hi_scale,
      scale, bias, out_channels, kernel, stride, padding, output_padding, dilation,
      groups):  # fmt: skip
    size = output_size(list(x.shape[2:]), kernel, stride, padding, output_padding, dilation)
    return empty_output(x, out_channels, size, False)
