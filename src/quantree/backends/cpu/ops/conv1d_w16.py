"""1-d convolutions with int16 weights (w16a8 and w16a16), ``csrc/conv1d_w16.cpp``.

Where a layer's 8-bit weights bound its accuracy, 16-bit weights are the fix, and without a
kernel they ran as a float conv on dequantized weights, which cost more than the float layer
(the graph's quantize/dequantize around it stay). This op reads the float input, quantizes
it as the reference's quantize op does (int8 with its zero point, or symmetric int16), and
sums its products with the int16 weights exactly (``csrc/conv1d_w16.cpp``), every group form
(plain, grouped, depthwise), any stride, padding and dilation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op
from quantree.backends.cpu.ops.conv1d import output_length

SIGNATURES: dict[str, list[type]] = {
    "qt_conv1d_w16": [PTR, *[I64] * 6, *[F32] * 4, *[I64] * 7, PTR, I64, PTR, PTR, PTR,
                      *[I64] * 3],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

OP = "conv1d_w16"


def packed_w16(values: Tensor) -> Tensor:
    """int16 weights ``[O, C / groups, K]`` as the kernel's rows ``[O, Rp]``: each output
    channel's products in the order ``c * K + k``, zero padded to an even depth (the kernel
    reads pairs)."""
    rows = values.reshape(values.shape[0], -1).to(torch.int16)
    depth = rows.shape[1] + rows.shape[1] % 2
    return torch.nn.functional.pad(rows, (0, depth - rows.shape[1])).contiguous()


def check_call(x: Tensor, x_zero_point: int, quant_min: int, quant_max: int, weight: Tensor,
               scale: Tensor, bias: Tensor | None, out_channels: int, kernel: list[int],
               stride: list[int], padding: list[int], dilation: list[int],
               groups: int) -> None:  # fmt: skip
    """Every argument the kernel indexes with: x float [N, C, L] on the CPU, the weight
    ``[out_channels, Rp]`` int16 with Rp even and at least ``C / groups * K``, the scale and
    bias one float per output channel, and codes whose value minus the zero point is int16."""
    check.dtype_of(OP, "x", x, torch.float32)
    if x.dim() != 3 or not x.is_cpu or x.numel() >= check.LIMIT:
        raise check.fail(
            OP, f"x of shape {tuple(x.shape)} on {x.device}: the kernel reads [N, C, L], CPU"
        )
    check.geometry(OP, kernel, stride, padding, dilation, 1)
    if not -(2**15) <= quant_min - x_zero_point <= quant_max - x_zero_point < 2**15:
        raise check.fail(
            OP, f"codes [{quant_min}, {quant_max}] on zero point {x_zero_point}: not int16 values"
        )
    c = int(x.shape[1])
    if not (1 <= groups < check.LIMIT and 1 <= out_channels < check.LIMIT):
        raise check.fail(OP, f"groups {groups} and out_channels {out_channels} out of range")
    if c % groups or out_channels % groups or c == 0:
        raise check.fail(
            OP, f"groups {groups} divides neither {c} input nor {out_channels} output channels"
        )
    check.dtype_of(OP, "weight", weight, torch.int16)
    depth = c // groups * kernel[0]
    if (
        weight.dim() != 2
        or int(weight.shape[0]) != out_channels
        or int(weight.shape[1]) % 2
        or int(weight.shape[1]) < depth
        or not weight.is_contiguous()
    ):
        raise check.fail(
            OP,
            f"weight of shape {tuple(weight.shape)} is not a contiguous [{out_channels}, Rp] "
            f"with an even Rp >= {depth}",
        )
    check.vector(OP, "scale", scale, torch.float32, out_channels)
    if bias is not None:
        check.vector(OP, "bias", bias, torch.float32, out_channels)


@op(
    "conv1d_w16(Tensor x, float x_scale, int x_zero_point, int quant_min, int quant_max, "
    "Tensor weight, Tensor scale, Tensor? bias, int out_channels, int[] kernel, int[] stride, "
    "int[] padding, int[] dilation, int groups) -> Tensor"
)
def conv1d_w16(
    x: Tensor,
    x_scale: float,
    x_zero_point: int,
    quant_min: int,
    quant_max: int,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_channels: int,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> Tensor:
    """Float ``x [N, C, L]`` quantized on (``x_scale``, ``x_zero_point``, ``quant_min``,
    ``quant_max``), convolved with int16 weights packed by ``packed_w16``: float
    ``[N, out_channels, L']`` = exact integer sum x ``scale`` (input scale x weight scale)
    + ``bias`` (float), contiguous."""
    check.positive(OP, "x_scale", x_scale)
    if x.dtype != torch.float32:
        x = x.float()
    check_call(x, x_zero_point, quant_min, quant_max, weight, scale, bias, out_channels, kernel,
               stride, padding, dilation, groups)  # fmt: skip
    n, c, length = x.shape
    ol = output_length(length, kernel[0], stride[0], padding, dilation[0])
    out = torch.empty((n, out_channels, max(ol, 0)), dtype=torch.float32)
    if ol <= 0 or n == 0:
        return out
    kernels().qt_conv1d_w16(
        x.data_ptr(), *x.stride(), n, c, length, 1.0 / x_scale, float(x_zero_point),
        float(quant_min), float(quant_max), out_channels, groups, kernel[0], stride[0],
        padding[0], dilation[0], ol, ptr(weight), int(weight.shape[1]), ptr(scale), ptr(bias),
        out.data_ptr(), *out.stride(),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::conv1d_w16")
def _(x, x_scale, x_zero_point, quant_min, quant_max, weight, scale, bias, out_channels, kernel,
      stride, padding, dilation, groups):  # fmt: skip
    ol = output_length(x.shape[2], kernel[0], stride[0], padding, dilation[0])
    return x.new_empty((x.shape[0], out_channels, ol), dtype=torch.float32)
