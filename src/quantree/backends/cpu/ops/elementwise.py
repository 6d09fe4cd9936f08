"""Elementwise int8 ops: quantize, dequantize, table lookup, add/mul, GLU; softmax over rows."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, INT, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import dense, op

SIGNATURES: dict[str, list[type]] = {
    "qt_quantize": [PTR, I64, F32, F32, PTR],
    "qt_dequantize": [PTR, I64, F32, F32, PTR],
    "qt_lookup": [PTR, I64, PTR, PTR],
    "qt_binary": [INT, PTR, PTR, I64, F32, F32, F32, F32, F32, F32, PTR],
    "qt_softmax": [PTR, I64, I64, PTR, F32, F32, PTR],
    "qt_glu": [PTR, I64, I64, I64, PTR, F32, F32, F32, F32, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


@op("quantize(Tensor x, float scale, int zero_point) -> Tensor")
def quantize(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """``quantized_decomposed.quantize_per_tensor`` to int8 [-128, 127], same arithmetic."""
    check.positive("quantize", "scale", scale)
    x = dense(x.float())
    out = torch.empty_like(x, dtype=torch.int8)
    kernels().qt_quantize(ptr(x), x.numel(), 1.0 / scale, float(zero_point), ptr(out))
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
    check.dequantize(q)
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    kernels().qt_dequantize(ptr(q), q.numel(), scale, float(zero_point), ptr(out))
    return out


@torch.library.register_fake("quantree::dequantize")
def _(q, scale, zero_point):
    return torch.empty(q.shape, dtype=torch.float32)


def in_memory_order(t: Tensor) -> Tensor:
    """A non-overlapping dense tensor's elements as a 1-d view, in the order they are stored.

    Elementwise kernels run over that: a channels-last conv output (4-d, or the 3-d of a
    conv1d) keeps its layout instead of being copied to contiguous and back.
    """
    return t.as_strided((t.numel(),), (1,))


def is_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive slots (its dims, ordered by
    stride, are contiguous): true of contiguous and channels-last tensors alike."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def dense_any_layout(t: Tensor) -> Tensor:
    """``t`` if dense in whatever layout, else a contiguous copy."""
    return t if is_dense(t) else t.contiguous()


@op("lookup(Tensor x, Tensor table) -> Tensor")
def lookup(x: Tensor, table: Tensor) -> Tensor:
    """``table[x + 128]`` for int8 ``x`` and a 256-entry int8 table; ``x``'s layout kept."""
    check.lookup(x, table)
    x = dense_any_layout(x)
    out = torch.empty_like(x)
    kernels().qt_lookup(ptr(in_memory_order(x)), x.numel(), ptr(table), ptr(in_memory_order(out)))
    return out


@torch.library.register_fake("quantree::lookup")
def _(x, table):
    if free_unbacked_symbols(x.shape):  # reading strides would guard on the size (binary's)
        return x.new_empty(x.shape)
    return torch.empty_like(dense_any_layout(x))


def same_strides(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one shape lay their elements out alike (a size-1 dimension's
    stride says nothing: a batch of one sliced from a channels-last map has any)."""
    return all(
        size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride(), strict=True)
    )


def same_layout(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` broadcast, then both dense with the same strides (copied if need be)."""
    if a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)
    if is_dense(a) and same_strides(a, b):
        return a, b
    return a.contiguous(), b.contiguous()


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
    """int8 ``a + b``, ``a * b`` or ``a - b`` (``kind``), broadcasting, requantized to int8.

    Two operands of one layout (a residual add of two channels-last conv outputs) are read
    and written in that layout; others are made contiguous first.
    """
    check.binary(kind, a, b, BINARY)
    check.positive("binary", "out_scale", out_scale)
    a, b = same_layout(a, b)
    out = torch.empty_like(a)
    kernels().qt_binary(
        BINARY[kind], ptr(in_memory_order(a)), ptr(in_memory_order(b)), a.numel(), a_scale,
        float(a_zero_point), b_scale, float(b_zero_point), 1.0 / out_scale,
        float(out_zero_point), ptr(in_memory_order(out)),
    )  # fmt: skip
    return out


def oblivious_broadcast(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    """The broadcast shape where only a literal 1 broadcasts, as aten's fake kernels read
    unbacked sizes (``torch.broadcast_shapes`` gives ``Max(1, u)``, which later ops guard
    on); other pairs of sizes must be equal, checked at run time."""
    a, b = [1] * (len(b) - len(a)) + list(a), [1] * (len(a) - len(b)) + list(b)
    shape = []
    for x, y in zip(a, b, strict=True):
        if isinstance(y, int) and y == 1:
            shape.append(x)
        elif isinstance(x, int) and x == 1:
            shape.append(y)
        else:
            torch._check(x == y)
            shape.append(x)
    return shape


@torch.library.register_fake("quantree::binary")
def _(kind, a, b, a_scale, a_zero_point, b_scale, b_zero_point, out_scale, out_zero_point):
    if free_unbacked_symbols((a.shape, b.shape)):
        # a data-dependent size (a padded packed sequence's length, when saving): comparing
        # shapes would guard on it; broadcast_shapes decides size-obliviously, as aten.add does
        return a.new_empty(oblivious_broadcast(a.shape, b.shape))
    return torch.empty_like(same_layout(a, b)[0])


@op("softmax(Tensor x, Tensor exp_table, float out_scale, int out_zero_point) -> Tensor")
def softmax(x: Tensor, exp_table: Tensor, out_scale: float, out_zero_point: int) -> Tensor:
    """int8 softmax over the last dimension; ``exp_table[d] = exp(-d * x_scale)``, d in 0..255.

    The reference's steps on the dequantized row (subtract the max, exp, normalise by the
    sum) with the exponentials looked up: it differs only by float rounding (rarely one
    output step).
    """
    check.softmax(x, exp_table)
    check.positive("softmax", "out_scale", out_scale)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.int8)
    cols = x.shape[-1]
    kernels().qt_softmax(
        ptr(x), x.numel() // cols if cols else 0, cols, ptr(exp_table), 1.0 / out_scale,
        float(out_zero_point), ptr(out),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::softmax")
def _(x, exp_table, out_scale, out_zero_point):
    return torch.empty(x.shape, dtype=torch.int8)


def memory_order(t: Tensor) -> list[int]:
    """``t``'s dims from outermost to innermost in memory (a channels-last conv output:
    channels last); dims of size 1 keep their place."""
    strides = t.stride()
    return sorted(range(t.dim()), key=lambda d: (-strides[d] if t.shape[d] != 1 else 0, d))


GluLayout = tuple[list[int], int, int, int, list[int]]
"""(memory order, outer, half, inner, inverse of the order) of a GLU's dense input."""
LAYOUTS_KEPT = 64


def glu_layout(x: Tensor, dim: int) -> GluLayout:
    """How GLU runs over dense ``x`` as it lies in memory: ``x.permute(order)`` is contiguous
    (else the identity order, after a copy), viewed as ``[outer, 2 * half, inner]``; the
    result is allocated in that order and permuted back, so it keeps ``x``'s layout."""
    return _layout(tuple(x.shape), tuple(x.stride()), dim)


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def _layout(shape: tuple[int, ...], stride: tuple[int, ...], dim: int) -> GluLayout:
    """``glu_layout`` of a tensor of this shape and stride (cached per layout: the same
    few layouts come back on every call)."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d] if shape[d] != 1 else 0, d))
    expected = 1
    for d in reversed(order):  # is x.permute(order) contiguous?
        if shape[d] != 1 and stride[d] != expected:
            order = list(range(len(shape)))
            break
        expected *= shape[d]
    pos = order.index(dim)
    sizes = [int(shape[d]) for d in order]
    outer = 1
    for size in sizes[:pos]:
        outer *= size
    inner = 1
    for size in sizes[pos + 1 :]:
        inner *= size
    return (order, outer, sizes[pos] // 2, inner, [order.index(d) for d in range(len(order))])


def halved(shape: Sequence[Any], order: list[int], dim: int) -> list[Any]:
    """``shape`` with ``dim`` halved, in memory ``order``."""
    return [shape[d] // 2 if d == dim else shape[d] for d in order]


@op("glu(Tensor x, int dim, Tensor gate, float scale, int zero_point, float out_scale, "
    "int out_zero_point) -> Tensor")  # fmt: skip
def glu(
    x: Tensor, dim: int, gate: Tensor, scale: float, zero_point: int, out_scale: float,
    out_zero_point: int,
) -> Tensor:  # fmt: skip
    """int8 ``glu(x, dim)``: ``dq(a) * gate[b + 128]`` requantized, ``a``/``b`` the halves of
    ``x`` along ``dim``, ``gate`` the 256 sigmoids of ``b``'s codes as aten's ``glu`` rounds
    them; the result keeps ``x``'s layout (channels-last stays channels-last)."""
    check.dtype_of("glu", "x", x, torch.int8)
    check.vector("glu", "gate", gate, torch.float32, 256)
    check.positive("glu", "out_scale", out_scale)
    check.positive("glu", "scale", scale)
    if not -x.dim() <= dim < x.dim() or x.shape[dim] % 2:
        raise check.fail("glu", f"dimension {dim} of x {list(x.shape)} is not one of even size")
    dim %= x.dim()
    if not is_dense(x):
        x = x.contiguous()
    order, outer, half, inner, back = glu_layout(x, dim)
    xp = x.permute(order)
    if not xp.is_contiguous():  # an order from a tie of strides: copied, as the kernel reads
        xp = xp.contiguous()
    out = torch.empty(halved(x.shape, order, dim), dtype=torch.int8)
    kernels().qt_glu(
        xp.data_ptr(), outer, half, inner, ptr(gate), scale, float(zero_point),
        1.0 / out_scale, float(out_zero_point), out.data_ptr(),
    )  # fmt: skip
    return out.permute(back)


@torch.library.register_fake("quantree::glu")
def _(x, dim, gate, scale, zero_point, out_scale, out_zero_point):
    dim %= x.dim()
    if free_unbacked_symbols(x.shape):  # reading strides would guard on the size
        return x.new_empty(halved(x.shape, list(range(x.dim())), dim))
    order = memory_order(x) if is_dense(x) else list(range(x.dim()))
    back = [order.index(d) for d in range(len(order))]
    return x.new_empty(halved(x.shape, order, dim)).permute(back)
