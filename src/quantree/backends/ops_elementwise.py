"""Elementwise int8 ops: quantize, dequantize, table lookup, add/mul."""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.native import library, ptr
from quantree.backends.registry import dense, op


@op("quantize(Tensor x, float scale, int zero_point) -> Tensor")
def quantize(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """``quantized_decomposed.quantize_per_tensor`` to int8 [-128, 127], same arithmetic."""
    x = dense(x.float())
    out = torch.empty_like(x, dtype=torch.int8)
    library().qt_quantize(ptr(x), x.numel(), 1.0 / scale, float(zero_point), ptr(out))
    return out


@torch.library.register_fake("quantree::quantize")
def _(x, scale, zero_point):
    return torch.empty_like(x, dtype=torch.int8)


@op("dequantize(Tensor q, float scale, int zero_point) -> Tensor")
def dequantize(q: Tensor, scale: float, zero_point: int) -> Tensor:
    """``quantized_decomposed.dequantize_per_tensor`` from int8, same arithmetic.

    The float result is contiguous whatever the layout of ``q`` (a channels-last conv
    output), as float code after it expects.
    """
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    library().qt_dequantize(ptr(q), q.numel(), scale, float(zero_point), ptr(out))
    return out


@torch.library.register_fake("quantree::dequantize")
def _(q, scale, zero_point):
    return torch.empty(q.shape, dtype=torch.float32)


@op("lookup(Tensor x, Tensor table) -> Tensor")
def lookup(x: Tensor, table: Tensor) -> Tensor:
    """``table[x + 128]`` for int8 ``x`` and a 256-entry int8 table."""
    x = dense(x)
    out = torch.empty_like(x)
    library().qt_lookup(ptr(x), x.numel(), ptr(table), ptr(out))
    return out


@torch.library.register_fake("quantree::lookup")
def _(x, table):
    return torch.empty_like(x)


BINARY = {"add": 0, "mul": 1, "sub": 2}


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
    """int8 ``a + b``, ``a * b`` or ``a - b`` (``kind``), broadcasting, requantized to int8."""
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
