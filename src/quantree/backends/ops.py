"""quantree's int8 CPU ops, registered as ``torch.ops.quantree.*`` custom ops.

They take and return plain tensors (int8 activations, packed int8 weights, int32 offsets,
float scales), have fake implementations, and so survive ``torch.export`` and
``torch.export.save``/``load``: importing ``quantree.backends`` registers them, nothing else
of quantree is needed to run a loaded model.

Each op is defined with a schema on a ``torch.library.Library`` fragment, with a CPU kernel
and ``torch.library.register_fake``. ``torch.library.custom_op`` would do the same with less
text, but its Python wrapper costs about 10 us a call against 3 us here, which is most of
the time of a small int8 layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from quantree.backends.native import library, ptr
from quantree.backends.packing import packed_depth

RNN_KINDS = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}
F = TypeVar("F", bound=Callable[..., Any])
PER_LAYER = 8  # per weight: packed int8, int32 row sums, per-channel scale, float bias


LIBRARY = torch.library.Library("quantree", "FRAGMENT")


def op(schema: str) -> Callable[[F], F]:
    """Define ``torch.ops.quantree.<name>`` from ``schema``, implemented by the function."""

    def register(fn: F) -> F:
        LIBRARY.define(schema)
        LIBRARY.impl(schema.split("(")[0], fn, "CPU")
        return fn

    return register


def _inverse(scale: float) -> float:
    return 1.0 / scale if scale > 0 else 0.0


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
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    shape = (*x.shape[:-1], out_features)
    quantized = out_scale > 0
    out = torch.empty(shape, dtype=torch.int8 if quantized else torch.float32)
    library().qt_linear(
        ptr(x2), x2.shape[0], x2.shape[1], out_features, packed_depth(weight), ptr(weight),
        ptr(offset), ptr(scale), ptr(bias), ptr(out) if quantized else None,
        None if quantized else ptr(out), _inverse(out_scale), float(out_zero_point), int(relu),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::linear")
def _(x, weight, offset, scale, bias, out_features, out_scale, out_zero_point, relu):
    dtype = torch.int8 if out_scale > 0 else torch.float32
    return x.new_empty((*x.shape[:-1], out_features), dtype=dtype)


def conv2d_shape(
    x: Tensor, out_channels: int, kernel: list[int], stride: list[int], padding: list[int],
    dilation: list[int],
) -> tuple[int, int, int, int]:  # fmt: skip
    n, _, h, w = x.shape
    oh = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    return n, out_channels, oh, ow


@op(
    "conv2d(Tensor x, Tensor weight, Tensor offset, Tensor scale, Tensor? bias, "
    "int out_channels, int[] kernel, int[] stride, int[] padding, int[] dilation, "
    "int x_zero_point, float out_scale, int out_zero_point, bool relu) -> Tensor"
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
) -> Tensor:
    """int8 convolution (groups = 1); int8 out (``out_scale > 0``) or float.

    Computed in channels-last layout: the result is an NCHW-shaped tensor with
    channels-last strides, which the next convolution reads without a copy.
    """
    x = x.contiguous(memory_format=torch.channels_last)
    shape = conv2d_shape(x, out_channels, kernel, stride, padding, dilation)
    quantized = out_scale > 0
    dtype = torch.int8 if quantized else torch.float32
    out = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)
    n, c, h, w = x.shape
    library().qt_conv2d(
        ptr(x), n, c, h, w, x_zero_point, out_channels, *kernel, *stride, *padding, *dilation,
        shape[2], shape[3], packed_depth(weight), ptr(weight), ptr(offset), ptr(scale),
        ptr(bias), ptr(out) if quantized else None, None if quantized else ptr(out),
        _inverse(out_scale), float(out_zero_point), int(relu),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::conv2d")
def _(x, weight, offset, scale, bias, out_channels, kernel, stride, padding, dilation,
      x_zero_point, out_scale, out_zero_point, relu):  # fmt: skip
    dtype = torch.int8 if out_scale > 0 else torch.float32
    shape = conv2d_shape(x, out_channels, kernel, stride, padding, dilation)
    return torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)


def _dense(t: Tensor) -> Tensor:
    channels_last = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    return t if channels_last else t.contiguous()


@op("quantize(Tensor x, float scale, int zero_point) -> Tensor")
def quantize(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """``quantized_decomposed.quantize_per_tensor`` to int8 [-128, 127], same arithmetic."""
    x = _dense(x.float())
    out = torch.empty_like(x, dtype=torch.int8)
    library().qt_quantize(ptr(x), x.numel(), 1.0 / scale, float(zero_point), ptr(out))
    return out


@torch.library.register_fake("quantree::quantize")
def _(x, scale, zero_point):
    return torch.empty_like(x, dtype=torch.int8)


@op("dequantize(Tensor q, float scale, int zero_point) -> Tensor")
def dequantize(q: Tensor, scale: float, zero_point: int) -> Tensor:
    """``quantized_decomposed.dequantize_per_tensor`` from int8, same arithmetic."""
    q = _dense(q)
    out = torch.empty_like(q, dtype=torch.float32)
    library().qt_dequantize(ptr(q), q.numel(), scale, float(zero_point), ptr(out))
    return out


@torch.library.register_fake("quantree::dequantize")
def _(q, scale, zero_point):
    return torch.empty_like(q, dtype=torch.float32)


@op("lookup(Tensor x, Tensor table) -> Tensor")
def lookup(x: Tensor, table: Tensor) -> Tensor:
    """``table[x + 128]`` for int8 ``x`` and a 256-entry int8 table."""
    x = _dense(x)
    out = torch.empty_like(x)
    library().qt_lookup(ptr(x), x.numel(), ptr(table), ptr(out))
    return out


@torch.library.register_fake("quantree::lookup")
def _(x, table):
    return torch.empty_like(x)


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
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a3 = a.expand(*batch, m, k).reshape(-1, m, k).contiguous()
    b3 = b.expand(*batch, k, n).reshape(-1, k, n).contiguous()
    quantized = out_scale > 0
    out = torch.empty((*batch, m, n), dtype=torch.int8 if quantized else torch.float32)
    library().qt_matmul(
        ptr(a3), ptr(b3), a3.shape[0], m, k, n, float(a_zero_point), float(b_zero_point),
        a_scale * b_scale, ptr(out) if quantized else None, None if quantized else ptr(out),
        _inverse(out_scale), float(out_zero_point),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::matmul")
def _(a, b, a_scale, a_zero_point, b_scale, b_zero_point, out_scale, out_zero_point):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    dtype = torch.int8 if out_scale > 0 else torch.float32
    return torch.empty((*batch, a.shape[-2], b.shape[-1]), dtype=dtype)


BINARY = {"add": 0, "mul": 1}


@op(
    "binary(str kind, Tensor a, Tensor b, float a_scale, int a_zero_point, float b_scale, "
    "int b_zero_point, float out_scale, int out_zero_point) -> Tensor"
)
def binary(
    kind: str,
    a: Tensor,
    b: Tensor,
    a_scale: float,
    a_zero_point: int,
    b_scale: float,
    b_zero_point: int,
    out_scale: float,
    out_zero_point: int,
) -> Tensor:
    """int8 ``a + b`` or ``a * b`` (``kind``), broadcasting, requantized to int8."""
    if a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape, dtype=torch.int8)
    library().qt_binary(
        BINARY[kind], ptr(a), ptr(b), a.numel(), a_scale, float(a_zero_point), b_scale,
        float(b_zero_point), 1.0 / out_scale, float(out_zero_point), ptr(out),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::binary")
def _(kind, a, b, a_scale, a_zero_point, b_scale, b_zero_point, out_scale, out_zero_point):
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.int8)


def _requantize(x: Tensor, scale: float, zero_point: int) -> Tensor:
    return quantize(x, scale, zero_point)


def _dequantize(q: Tensor, scale: float, zero_point: int) -> Tensor:
    return dequantize(q, scale, zero_point)


@op(
    "rnn(str kind, Tensor x, Tensor[] hx, Tensor[] params, int hidden, int num_layers, "
    "bool bidirectional, bool batch_first, float[] qparams, int hidden_bits) "
    "-> (Tensor, Tensor, Tensor)"
)
def rnn(
    kind: str,
    x: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    hidden: int,
    num_layers: int,
    bidirectional: bool,
    batch_first: bool,
    qparams: list[float],
    hidden_bits: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """A whole int8 LSTM/GRU/RNN: ``(output, h_n, c_n)``, all int8 (``c_n`` empty if no cell).

    ``qparams``: (scale, zero point) of the input, the inner int8 grid (outputs passed
    between layers), the output, the h state, the c state, then the scale of the hidden state
    fed back: on the inner grid when ``hidden_bits`` is 8, symmetric int16 when 16.
    ``params``: per layer and direction, ``w_ih, rowsum_ih, scale_ih, b_ih`` and the same for
    ``hh``: packed int8 weights, their int32 row sums, per-channel scales, float biases.
    """
    x_s, x_z, inner_s, inner_z, y_s, y_z, h_s, h_z, c_s, c_z, fb_s = qparams
    wide = hidden_bits == 16
    fb_s, fb_z = (fb_s, 0.0) if wide else (inner_s, inner_z)
    lib, code, dirs = library(), RNN_KINDS[kind], 2 if bidirectional else 1
    inp = (x.transpose(0, 1) if batch_first else x).contiguous()
    steps, batch = inp.shape[0], inp.shape[1]
    h = _dequantize(hx[0], h_s, int(h_z)).contiguous()
    c = _dequantize(hx[1], c_s, int(c_z)).contiguous() if kind == "lstm" else None
    for layer in range(num_layers):
        last = layer == num_layers - 1
        out_s, out_z = (y_s, y_z) if last else (inner_s, inner_z)
        in_s, in_z = (x_s, x_z) if layer == 0 else (inner_s, inner_z)
        y = torch.empty(steps, batch, dirs * hidden, dtype=torch.int8)
        for d in range(dirs):
            i = layer * dirs + d
            w_ih, sum_ih, sc_ih, b_ih, w_hh, sum_hh, sc_hh, b_hh = params[
                i * PER_LAYER : (i + 1) * PER_LAYER
            ]
            lib.qt_rnn_layer(
                code, steps, batch, inp.shape[2], hidden, d, ptr(inp), in_s, in_z, ptr(w_ih),
                packed_depth(w_ih), ptr(sum_ih), ptr(sc_ih), ptr(b_ih), ptr(w_hh),
                packed_depth(w_hh), ptr(sum_hh), ptr(sc_hh), ptr(b_hh), h_s, h_z, fb_s, fb_z,
                int(wide), y.data_ptr() + d * hidden, dirs * hidden, out_s, out_z, ptr(h[i]),
                None if c is None else ptr(c[i]),
            )  # fmt: skip
        inp = y
    out = inp.transpose(0, 1).contiguous() if batch_first else inp
    h_n = _requantize(h, h_s, int(h_z))
    c_n = _requantize(c, c_s, int(c_z)) if c is not None else x.new_empty((0,))
    return out, h_n, c_n


@torch.library.register_fake("quantree::rnn")
def _(kind, x, hx, params, hidden, num_layers, bidirectional, batch_first, qparams, hidden_bits):
    dirs = 2 if bidirectional else 1
    out = x.new_empty((*x.shape[:2], dirs * hidden), dtype=torch.int8)
    c_n = hx[1].new_empty(hx[1].shape) if kind == "lstm" else x.new_empty((0,))
    return out, hx[0].new_empty(hx[0].shape), c_n
