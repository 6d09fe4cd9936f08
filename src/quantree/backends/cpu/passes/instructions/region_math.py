"""The arithmetic of recurrence steps in region programs: scalar operands, exp / log /
softplus / rsqrt / abs, division, maximum / minimum, clamps, batched matmuls, transposes of
the last two dimensions, sums, means and variances over the last one.

A selective scan's or a gated linear recurrence's step (``recurrent.unrolled``) is a few
such ops on small tensors: ``1 - z``, ``exp(A dt)``, ``softplus``, ``state @ C``. Without
them in programs the step cannot be one program, so its loop runs op by op in Python. Each
is float32 arithmetic as ATen's (``csrc/qt_program.h``: ``FLOAT_SCALAR``, ``FLOAT_UNARY``
7-11, ``FLOAT_BINARY`` 3-5, ``FLOAT_MATMUL``, ``ROW_SUM``), an int8 matmul through
``qt_matmul`` (``MATMUL``: the same bits as ``quantree.matmul``), or a move (``TRANSPOSE``).
``passes/regions.py`` asks ``covered`` and ``emit`` before its own cases.

xLSTM's chunkwise mLSTM step needs the last three: ``C' = s C + K^T @ V`` and
``n' = s n + K^T.sum(-1)``, its scale ``s`` a ``[B, H, 1, 1]`` value per ``[D, D]`` block
(``block_column``: copied out to one value per row, then ``FLOAT_BINARY``'s column flag).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu.passes.instructions.region_layout import (
    MAX_COPIES,
    copies,
    reshape,
    row_map,
)

aten = torch.ops.aten
FLOAT_BINARY, FLOAT_UNARY, FLOAT_SCALAR, MATMUL, FLOAT_MATMUL = 7, 8, 12, 13, 14
TRANSPOSE, ROW_SUM = 20, 21
SCALAR_KINDS = {
    aten.add.Tensor: 0, aten.add.Scalar: 0, aten.mul.Tensor: 1, aten.mul.Scalar: 1,
    aten.sub.Tensor: 2, aten.sub.Scalar: 2, aten.rsub.Scalar: 3, aten.div.Tensor: 4,
    aten.div.Scalar: 4, aten.clamp_min.default: 6, aten.clamp_max.default: 7,
    aten.pow.Tensor_Scalar: 8,
}  # fmt: skip
"""``x op scalar`` (``FLOAT_SCALAR`` kinds; 5, ``scalar / x``, has no single aten op)."""
UNARY_KINDS = {
    aten.exp.default: 7, aten.log.default: 8, aten.softplus.default: 9, aten.rsqrt.default: 10,
    aten.abs.default: 11,
}  # fmt: skip
BINARY_KINDS = {
    aten.div.Tensor: 3, aten.max.other: 4, aten.min.other: 5, aten.maximum.default: 4,
    aten.minimum.default: 5,
}  # fmt: skip
"""``torch.max(a, b)`` is ``maximum`` (NaN wins in both); listed first, so that a kind read
back (``regions.float_ops_of_code``) names ``maximum``."""
MATMULS = {aten.matmul.default, aten.bmm.default}
VECTOR_EXP, VECTOR_EXP_KIND = 12288, 12
"""An ``exp`` of more values than this runs as eight-lane rows (``FLOAT_UNARY`` kind 12, equal
to libm's up to about 1 ulp, 0 below -87.3): libm's element by element loop was the largest
single cost left in Mamba-2's programs at 512 tokens. Smaller ones keep libm's bits."""
VECTOR_SOFTPLUS, VECTOR_SOFTPLUS_KIND = 2048, 13
"""A ``softplus`` of more values than this runs as eight-lane rows (kind 13: kind 12's exp,
cephes' log, within a few ulps of ATen's; x above 20 as is): libm's exp and log1p per element
cost Mamba-2's program at 512 tokens as much as its time steps' other ops together. Smaller
ones keep libm's bits."""
SWAPS = (aten.transpose.int, aten.permute.default)

Shape = tuple[tuple[Any, ...], torch.dtype]


def _values(shape: Shape) -> int:
    """Elements of a fixed shape (0 for a symbolic one: counted small)."""
    total = 1
    for d in shape[0]:
        if type(d) is not int:
            return 0
        total *= d
    return total


def _scalar(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _scalar_op(n: fx.Node) -> tuple[int, float] | None:
    """``n`` as ``(kind, scalar)`` if it is a float tensor op a scalar."""
    a: Any = n.args
    kind = SCALAR_KINDS.get(n.target)  # type: ignore[call-overload]
    if kind is None or len(a) != 2 or not isinstance(a[0], fx.Node) or not _scalar(a[1]):
        return None
    if (n.kwargs and set(n.kwargs) != {"alpha"}) or n.kwargs.get("alpha", 1) != 1:
        return None
    return kind, float(a[1])


def _matmul_dims(n: fx.Node, shapes: dict[fx.Node, Shape]) -> tuple[int, int] | None:
    """``(M, rank)`` of a batched matmul of two operands of one batch shape (or None)."""
    a: Any = n.args
    if len(a) < 2 or not all(isinstance(x, fx.Node) and x in shapes for x in a[:2]):
        return None
    (sa, _), (sb, _) = shapes[a[0]], shapes[a[1]]
    if len(sa) != len(sb) or len(sa) < 2 or sa[:-2] != sb[:-2] or sa[-1] != sb[-2]:
        return None
    if not all(type(d) is int for d in (sa[-2], sa[-1], sb[-1])):
        return None
    return sa[-2], len(sa)


def infer(n: fx.Node, shapes: dict[fx.Node, Shape], math: bool = False) -> None:
    """The shape of a ``quantree.matmul`` (the lowering's int8 ops carry none), and in a
    folded step (``math``) of a transpose of one (an int8 ``K^T``)."""
    a: Any = n.args
    if math and n not in shapes and n.target in (*SWAPS, aten.mT.default) and not n.kwargs:
        src = shapes.get(a[0]) if a and isinstance(a[0], fx.Node) else None
        rank = len(src[0]) if src is not None else 0
        if src is not None and rank >= 2:
            dims = list(src[0])
            dims[-2], dims[-1] = dims[-1], dims[-2]
            shapes[n] = (tuple(dims), src[1])
            if not swaps_last(n, shapes):  # another permute: its shape unknown here
                del shapes[n]
    if n.target != torch.ops.quantree.matmul.default or n in shapes:
        return
    if _matmul_dims(n, shapes) is None:
        return
    sa, sb = shapes[a[0]][0], shapes[a[1]][0]
    shapes[n] = ((*sa[:-1], sb[-1]), torch.int8 if float(a[6]) > 0 else torch.float32)


def column(shape: Shape, out: Shape) -> bool:
    """``shape`` is a float32 column of ``out``'s rows: ``[..., M, 1]`` read as one value per
    row of ``[..., M, N]`` (an outer product's ``a[..., None] * b[..., None, :]``)."""
    (src, dtype), dims = shape, out[0]
    if dtype != out[1] or not src or not dims or src[-1] != 1 or dims[-1] == 1:
        return False
    lead = (1,) * (len(dims) - len(src)) + tuple(src[:-1])
    return len(lead) == len(dims) - 1 and all(x == y for x, y in zip(lead, dims[:-1], strict=True))


def block_column(shape: Shape, out: Shape) -> list[tuple[int, int]] | None:
    """Where ``shape`` (``[..., 1]``) broadcasts to ``out``'s rows along leading dimensions
    too (``[B, H, 1, 1]`` over ``[B, H, D, N]``): the rows of the column ``[..., M, 1]`` as
    ``region_layout.gather`` copies them out of it (None: not such an operand)."""
    (src, dtype), dims = shape, out[0]
    if dtype != out[1] or not src or not dims or src[-1] != 1 or dims[-1] == 1:
        return None
    rows = row_map(src, (*dims[:-1], 1), None)
    return rows if rows is not None and copies(rows) <= MAX_COPIES else None


def swaps_last(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool:
    """``n`` is a transpose (or permute) of the last two dimensions only, of fixed sizes,
    that moves elements (both of them more than 1)."""
    a: Any = n.args
    src = shapes.get(a[0]) if a and isinstance(a[0], fx.Node) else None
    if n.target not in (*SWAPS, aten.mT.default) or src is None or n.kwargs:
        return False
    rank = len(src[0])
    if rank < 2 or not all(type(d) is int for d in src[0][-2:]) or 1 in src[0][-2:]:
        return False
    if n.target == aten.mT.default:
        return True
    if n.target == aten.transpose.int:
        return {a[1] % rank, a[2] % rank} == {rank - 2, rank - 1}
    perm = [d % rank for d in a[1]]
    return perm == [*range(rank - 2), rank - 1, rank - 2]


def _last_sum(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool:
    """``n`` is a float32 ``sum`` over the last dimension alone."""
    a: Any = n.args
    src = shapes.get(a[0]) if a and isinstance(a[0], fx.Node) else None
    if n.target != aten.sum.dim_IntList or src is None or not src[0] or len(a) < 2:
        return False
    dims = a[1] if isinstance(a[1], (list, tuple)) else [a[1]]
    dtype = n.kwargs.get("dtype")
    rank = len(src[0])
    return (
        len(dims) == 1 and dims[0] % rank == rank - 1 and set(n.kwargs) <= {"dtype"}
        and dtype in (None, torch.float32) and src[1] == torch.float32
    )  # fmt: skip


LAST_MEANS = {aten.mean.dim, aten.var.dim, aten.var.correction}


def last_moment(n: fx.Node, shapes: dict[fx.Node, Shape]) -> float | None:
    """For a float32 ``mean`` or ``var`` over the last dimension alone (a multi-head layer
    norm's statistics): the divisor of its sum (``N``, or ``N - correction``); else None."""
    a: Any = n.args
    src = shapes.get(a[0]) if a and isinstance(a[0], fx.Node) else None
    if n.target not in LAST_MEANS or src is None or not src[0] or src[1] != torch.float32:
        return None
    dims = a[1] if len(a) > 1 else n.kwargs.get("dim")
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    rank, cols = len(src[0]), src[0][-1]
    if len(dims) != 1 or not isinstance(dims[0], int) or dims[0] % rank != rank - 1:
        return None
    if n.target == aten.mean.dim:
        ok = set(n.kwargs) <= {"dtype"} and n.kwargs.get("dtype") in (None, torch.float32)
        return float(cols) if ok and len(a) <= 3 else None
    correction: Any
    if n.target == aten.var.dim:
        unbiased = a[2] if len(a) > 2 else n.kwargs.get("unbiased", True)
        correction = 1 if unbiased else 0
    else:
        correction = n.kwargs.get("correction", a[2] if len(a) > 2 else 1)
        correction = 1 if correction is None else correction
    known = {"unbiased", "correction", "keepdim"}
    if not isinstance(correction, (int, float)) or set(n.kwargs) - known:
        return None
    return float(cols - correction) if cols - correction > 0 else None


def covered(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool | None:
    """Whether the program runs ``n`` (None: not an op of this module's)."""
    a: Any = n.args
    out = shapes.get(n)
    floats = out is not None and out[1] == torch.float32
    if last_moment(n, shapes) is not None:
        return floats
    if swaps_last(n, shapes):
        return out is not None and out[1] == shapes[a[0]][1]
    if _last_sum(n, shapes):
        return floats
    if n.target in SCALAR_KINDS and _scalar_op(n) is not None:
        return floats and shapes.get(a[0]) == out
    if n.target == aten.clamp.default:
        bounds = [x for x in a[1:3] if x is not None]
        return floats and shapes.get(a[0]) == out and all(_scalar(x) for x in bounds)
    if n.target in UNARY_KINDS:
        if n.target == aten.softplus.default and tuple(a[1:]) not in ((), (1,), (1, 20)):
            return False
        return floats and not n.kwargs and shapes.get(a[0]) == out
    if n.target in BINARY_KINDS and len(a) == 2 and all(isinstance(x, fx.Node) for x in a):
        equal = [shapes.get(x) == out for x in a]
        cols = [out is not None and x in shapes and column(shapes[x], out) for x in a]
        return floats and not n.kwargs and all(e or c for e, c in zip(equal, cols, strict=True))
    if n.target in MATMULS:
        same = all(shapes.get(x, ((), None))[1] == torch.float32 for x in a[:2])
        return floats and same and _matmul_dims(n, shapes) is not None
    if n.target == torch.ops.quantree.matmul.default:
        same = all(shapes.get(x, ((), None))[1] == torch.int8 for x in a[:2])
        return out is not None and same and _matmul_dims(n, shapes) is not None
    return None


def _moment(p: Any, n: fx.Node, src: int, dst: int, divisor: float) -> None:
    """``mean`` (the row sums over ``N``) or ``var`` (the row sums of squared deviations
    from the mean, over ``N - correction``) as ``ROW_SUM``, ``FLOAT_SCALAR`` and
    ``FLOAT_BINARY`` with a column operand; the sums in double (``ROW_SUM``)."""
    rows, cols = p.slots[src][5], p.slots[src][3]
    out = reshape(p, dst, rows, 1)
    total = p.alloc_rows(torch.float32, rows, 1)
    p.emit([ROW_SUM, total, src], [])
    if n.target == aten.mean.dim:
        p.emit([FLOAT_SCALAR, out, total, 1], [1.0 / divisor])
        return
    mean = p.alloc_rows(torch.float32, rows, 1)
    p.emit([FLOAT_SCALAR, mean, total, 1], [1.0 / cols])
    dev = p.alloc_rows(torch.float32, rows, cols)
    p.emit([FLOAT_BINARY, dev, src, mean, 2, 1], [])  # x - mean, b a column
    square = p.alloc_rows(torch.float32, rows, cols)
    p.emit([FLOAT_BINARY, square, dev, dev, 1, 0], [])
    sums = p.alloc_rows(torch.float32, rows, 1)
    p.emit([ROW_SUM, sums, square], [])
    p.emit([FLOAT_SCALAR, out, sums, 1], [1.0 / divisor])


def emit(
    p: Any, n: fx.Node, slot: dict[fx.Node, int], value_slot: Callable[[fx.Node], int | None],
    shapes: dict[fx.Node, Shape],
) -> bool | None:  # fmt: skip
    """Append ``n``'s instructions (None: not an op of this module's; False: refused)."""
    a: Any = n.args
    if covered(n, shapes) is None:
        return None
    dst = value_slot(n)
    if dst is None:
        return False
    if swaps_last(n, shapes):
        p.emit([TRANSPOSE, dst, slot[a[0]], shapes[a[0]][0][-2]], [])
    elif _last_sum(n, shapes):  # one value per source row: the result's elements as a column
        rows = p.slots[slot[a[0]]][5]
        p.emit([ROW_SUM, reshape(p, dst, rows, 1), slot[a[0]]], [])
    elif (divisor := last_moment(n, shapes)) is not None:
        _moment(p, n, slot[a[0]], dst, divisor)
    elif n.target == aten.clamp.default:
        src = slot[a[0]]
        bounds = [(6, a[1] if len(a) > 1 else None), (7, a[2] if len(a) > 2 else None)]
        steps = [(k, float(v)) for k, v in bounds if v is not None]
        if not steps:
            return False
        for i, (kind, value) in enumerate(steps):
            target = dst if i == len(steps) - 1 else value_slot(n)
            assert target is not None
            p.emit([FLOAT_SCALAR, target, src, kind], [value])
            src = target
    elif (scalar := _scalar_op(n)) is not None:
        p.emit([FLOAT_SCALAR, dst, slot[a[0]], scalar[0]], [scalar[1]])
    elif n.target in UNARY_KINDS:
        kind = UNARY_KINDS[n.target]  # type: ignore[index]
        if n.target == aten.exp.default and _values(shapes[n]) > VECTOR_EXP:
            kind = VECTOR_EXP_KIND
        if n.target == aten.softplus.default and _values(shapes[n]) > VECTOR_SOFTPLUS:
            kind = VECTOR_SOFTPLUS_KIND
        p.emit([FLOAT_UNARY, dst, slot[a[0]], kind], [])
    elif n.target in BINARY_KINDS:  # flag 1 (2): b (a) is a column, one value per row
        flag = 1 if shapes[a[1]] != shapes[n] else 2 if shapes[a[0]] != shapes[n] else 0
        kind = BINARY_KINDS[n.target]  # type: ignore[index]
        p.emit([FLOAT_BINARY, dst, slot[a[0]], slot[a[1]], kind, flag], [])
    else:
        dims = _matmul_dims(n, shapes)
        assert dims is not None
        if any(p.slots[s][3] != p.slots[s][4] for s in (slot[a[0]], slot[a[1]])):
            return False  # a view of a wider value: the kernels read dense operands
        if n.target == torch.ops.quantree.matmul.default:
            scale = float(a[2]) * float(a[4])
            inv = 1.0 / float(a[6]) if float(a[6]) > 0 else 0.0
            floats = [float(a[3]), float(a[5]), scale, inv, float(a[7])]
            p.emit([MATMUL, dst, slot[a[0]], slot[a[1]], dims[0]], floats)
        else:
            p.emit([FLOAT_MATMUL, dst, slot[a[0]], slot[a[1]], dims[0]], [])
    slot[n] = dst
    return True
