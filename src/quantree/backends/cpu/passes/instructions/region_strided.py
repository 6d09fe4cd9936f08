"""Mamba-2's chunked SSD in region programs: strided moves, running sums, triangular masks,
einsums as batched matmuls, pads and zeros.

The SSD (transformers' ``mamba2_chunk_scan``) is ~80 small float ATen ops a layer: permutes
that move the last dimension, ``expand`` of a ``[..., 1]`` column, ``cumsum`` along the last
dimension and along ``-2``, ``masked_fill`` with a lower-triangular mask, five ``einsum``s,
``pad``, ``zeros_like``, ``select``. Each is a dispatcher call costing more than its
arithmetic at these sizes, and each ends a program, so two thirds of the lowered model's
time was Python between kernels. Here each becomes instructions (``csrc/qt_program.h``):

- ``STRIDED``: any view of up to 4 merged dimensions (a permute, an expand's stride 0, a
  select's offset) copied dense; the same bits.
- ``CUMSUM``: running sums in double, as ATen's CPU kernel (the same bits), along each row or
  down each block of ``R`` rows (a cumsum over ``-2``).
- ``TRI_FILL``: ``masked_fill`` whose constant mask is ``j - i > k`` (``~tril(ones, k)``),
  checked against the constant at lowering; with ``k`` below every row, a constant fill
  (``zeros_like``, a pad's border).
- an ``einsum`` of two operands with no summed-away letter: each operand copied (``STRIDED``)
  to ``[batch, M, K]`` / ``[batch, K, N]`` unless already so, ``FLOAT_MATMUL``, and the result
  copied to the equation's order unless already so.

Values over ``MAX_ELEMENTS`` stay ATen's: a program's workspace holds every value it makes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu.passes.instructions.region_layout import COPY, reshape
from quantree.core.graphs import attr_at

aten = torch.ops.aten
FLOAT_MATMUL, CUMSUM, TRI_FILL, STRIDED = 14, 22, 23, 24
DIMS = 4
"""``STRIDED``'s dimensions (``c[3..6]`` sizes, ``c[7..10]`` strides)."""
MAX_ELEMENTS = 1 << 17
"""Largest value (elements) these ops make or read in a program (and, in a whole model's
program, ``region_math``'s): Mamba-2's largest at 512 tokens, ``[1, 33, 8, 16, 16]``, fits.
Far larger values are left to ATen, whose vectorized kernels (exp, a blocked matmul) then win
over the program's loops, and which does not hold every value it makes at once as a
program's workspace does."""
ALL = -(1 << 30)
"""``TRI_FILL``'s diagonal offset that fills every column."""
SQUEEZES = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
SPLITS = {aten.split_with_sizes.default, aten.tensor_split.indices}
PADS = {aten.pad.default, aten.constant_pad_nd.default}
Shape = tuple[tuple[Any, ...], torch.dtype]


def _static(shape: Shape | None) -> bool:
    return bool(
        shape is not None
        and shape[0]
        and all(type(d) is int for d in shape[0])
        and shape[1] == torch.float32
        and math.prod(shape[0]) <= MAX_ELEMENTS
    )


def merge(sizes: list[int], strides: list[int]) -> list[tuple[int, int]]:
    """``(size, stride)`` with size-1 dimensions dropped and contiguous neighbours joined."""
    out: list[tuple[int, int]] = []
    for size, stride in zip(sizes, strides, strict=True):
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out or [(1, 1)]


def dense_strides(dims: tuple[int, ...], ld: int | None = None) -> list[int]:
    """Element strides of a value of ``dims`` held in a slot of row stride ``ld``."""
    ld = dims[-1] if ld is None else ld
    return [ld * math.prod(dims[d + 1 : -1]) for d in range(len(dims) - 1)] + [1]


def _perm(n: fx.Node, rank: int) -> list[int] | None:
    a: Any = n.args
    if n.target == aten.permute.default:
        return [d % rank for d in a[1]]
    if n.target == aten.transpose.int:
        perm = list(range(rank))
        d0, d1 = a[1] % rank, a[2] % rank
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    return None


def _view(
    n: fx.Node, shapes: dict[fx.Node, Shape], strides: list[int] | None = None
) -> tuple[list[int], list[int], int] | None:
    """``n`` (a permute, expand, repeat of a size-1 dim, select) as sizes, strides into its
    source (``strides``: the source's in its slot; dense if not given) and a first element
    (None: not such a view)."""
    a: Any = n.args
    src, out = shapes.get(a[0]), shapes.get(n)
    if not _static(src) or not _static(out) or src[1] != out[1]:  # type: ignore[index]
        return None
    sdims, odims = src[0], out[0]  # type: ignore[index]
    strides = dense_strides(sdims) if strides is None else strides
    if n.target in (aten.permute.default, aten.transpose.int):
        perm = _perm(n, len(sdims))
        if perm is None or sorted(perm) != list(range(len(sdims))):
            return None
        return list(odims), [strides[d] for d in perm], 0
    if n.target in (aten.expand.default, aten.repeat_interleave.self_int):
        if n.target == aten.repeat_interleave.self_int:  # of a size-1 dim: an expand
            dim = a[2] % len(sdims) if len(a) > 2 and isinstance(a[2], int) else None
            if dim is None or sdims[dim] != 1 or len(odims) != len(sdims):
                return None
        pad = len(odims) - len(sdims)
        if pad < 0:
            return None
        sizes, steps = [], []
        for j, size in enumerate(odims):
            i = j - pad
            if i < 0 or sdims[i] == 1:
                sizes.append(size)
                steps.append(0)
            elif sdims[i] == size:
                sizes.append(size)
                steps.append(strides[i])
            else:
                return None
        return sizes, steps, 0
    if n.target == aten.select.int and len(a) == 3:
        dim = a[1] % len(sdims)
        index = a[2] + sdims[dim] if a[2] < 0 else a[2]
        if not 0 <= index < sdims[dim]:
            return None
        keep = [d for d in range(len(sdims)) if d != dim]
        return [sdims[d] for d in keep], [strides[d] for d in keep], index * strides[dim]
    return None


def _mask_offset(n: fx.Node, shapes: dict[fx.Node, Shape]) -> int | None:
    """The ``k`` with ``mask == (j - i > k)`` of ``masked_fill(x, mask, value)``'s constant
    mask over ``x``'s last two dimensions (None: another mask)."""
    a: Any = n.args
    mask = a[1] if len(a) > 1 else None
    out = shapes.get(n)
    if not isinstance(mask, fx.Node) or mask.op != "get_attr" or out is None or len(out[0]) < 2:
        return None
    gm = n.graph.owning_module
    value = attr_at(gm, str(mask.target)) if gm is not None else None
    rows, cols = out[0][-2:]
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() < 2:
        return None
    if tuple(value.shape[-2:]) != (rows, cols) or value.numel() != rows * cols:
        return None
    i = torch.arange(rows)[:, None]
    j = torch.arange(cols)[None, :]
    grid = value.reshape(rows, cols)
    for k in range(-rows, cols + 1):
        if torch.equal(grid, j - i > k):
            return k
    return None


def _pads(n: fx.Node, shapes: dict[fx.Node, Shape]) -> tuple[int, int, int, float] | None:
    """A constant pad as ``(dim, before, after, value)`` (``before == after == 0``: none)."""
    a: Any = n.args
    src = shapes.get(a[0])
    mode: Any = a[2] if len(a) > 2 else n.kwargs.get("mode", "constant")
    value: Any = a[3] if len(a) > 3 else n.kwargs.get("value", 0.0)
    if n.target == aten.constant_pad_nd.default:
        mode, value = "constant", a[2] if len(a) > 2 else 0.0
    if src is None or mode != "constant" or not isinstance(a[1], (list, tuple)):
        return None
    value = 0.0 if value is None else value
    pads = list(a[1])
    if len(pads) % 2 or len(pads) // 2 > len(src[0]) or any(p < 0 for p in pads):
        return None
    moved = [(len(src[0]) - 1 - i // 2, pads[i], pads[i + 1]) for i in range(0, len(pads), 2)]
    moved = [m for m in moved if m[1] or m[2]]
    if not moved:
        return 0, 0, 0, float(value)
    if len(moved) > 1:
        return None
    dim, before, after = moved[0]
    out = shapes[n][0]
    if dim != len(out) - 1 and math.prod(out[:dim]) != 1:
        return None  # neither the columns nor whole rows
    return dim, before, after, float(value)


def _einsum(n: fx.Node, shapes: dict[fx.Node, Shape]) -> dict[str, Any] | None:
    """An einsum of two operands as batched matmul letters (None: another einsum)."""
    a: Any = n.args
    if len(a) != 2 or not isinstance(a[0], str) or len(a[1]) != 2 or "->" not in a[0]:
        return None
    ins, out = a[0].replace(" ", "").split("->")
    if ins.count(",") != 1 or "." in a[0]:
        return None
    la, lb = ins.split(",")
    x, y = a[1]
    sx, sy = shapes.get(x), shapes.get(y)
    if not (_static(sx) and _static(sy) and _static(shapes.get(n))):
        return None
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(out)) != len(out):
        return None
    if len(la) != len(sx[0]) or len(lb) != len(sy[0]) or len(out) != len(shapes[n][0]):  # type: ignore[index]
        return None
    if any(c not in out and c not in (lb if c in la else la) for c in la + lb):
        return None  # a letter summed in one operand alone
    size = {c: d for c, d in zip(la, sx[0], strict=True)}  # type: ignore[index]
    for c, d in zip(lb, sy[0], strict=True):  # type: ignore[index]
        if size.setdefault(c, d) != d:
            return None
    if any(c not in size for c in out):
        return None
    batch = [c for c in out if c in la and c in lb]
    m = [c for c in out if c in la and c not in lb]
    k = [c for c in la if c in lb and c not in out]
    nn = [c for c in out if c in lb and c not in la]
    tmp = math.prod(size[c] for c in batch + m + nn)
    if max(tmp, math.prod(size[c] for c in batch + m + k)) > MAX_ELEMENTS:
        return None
    return {"a": la, "b": lb, "out": out, "size": size, "batch": batch, "m": m, "k": k, "n": nn}


def covered(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool | None:
    """Whether a program runs ``n`` through this module (None: not one of its ops)."""
    a: Any = n.args
    out = shapes.get(n)
    if n.target == aten.einsum.default:
        return _einsum(n, shapes) is not None
    if n.target in (aten.repeat_interleave.self_int, aten.select.int):
        return moves(n, shapes)
    if n.target == aten.cumsum.default:
        src = shapes.get(a[0])
        rank = len(out[0]) if out else 0
        dim = a[1] % rank if rank and isinstance(a[1], int) else -1
        plain = set(n.kwargs) <= {"dtype"} and n.kwargs.get("dtype") in (None, torch.float32)
        return _static(out) and src == out and plain and dim >= rank - 2 >= -1
    if n.target == aten.masked_fill.Scalar:
        value = a[2] if len(a) > 2 else None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return (
            _static(out) and shapes.get(a[0]) == out and ok and _mask_offset(n, shapes) is not None
        )
    if n.target in PADS:
        return _static(out) and _static(shapes.get(a[0])) and _pads(n, shapes) is not None
    if n.target == aten.zeros_like.default:
        extra = set(n.kwargs) - {"dtype", "layout", "device", "pin_memory", "memory_format"}
        return _static(out) and not extra
    return None


def moves(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool:
    """A permute or expand the program runs as ``STRIDED`` (row copies cannot: the last
    dimension moves or spreads)."""
    view = _view(n, shapes)
    return view is not None and len(merge(view[0], view[1])) <= DIMS


def _tensor_strides(p: Any, src: int, dims: tuple[int, ...]) -> list[int]:
    return dense_strides(dims, p.slots[src][4])


def strided(p: Any, src: int, sizes: list[int], steps: list[int], start: int, cols: int) -> int:
    """A dense slot of ``cols`` columns holding ``src``'s elements at ``sizes`` / ``steps``
    from element ``start``: a view where they are ``src``'s first elements in order."""
    dtype, base, offset, _, _, _ = p.slots[src]
    elem = 4 if dtype == 0 else 1
    dims = merge(sizes, steps)
    total = math.prod(sizes)
    rows = total // cols
    if len(dims) == 1 and dims[0][1] == 1:
        p.slots.append([dtype, base, offset + start * elem, cols, cols, rows])
        return len(p.slots) - 1
    if len(dims) > DIMS:
        raise ValueError("too many dimensions")
    if start:
        p.slots.append([dtype, base, offset + start * elem, 1, 1, 1])
        src = len(p.slots) - 1
    dims = [(1, 0)] * (DIMS - len(dims)) + dims
    dst = len(p.slots)
    p.slots.append([dtype, dst, 0, cols, cols, rows])
    p.emit([STRIDED, dst, src, *(s for s, _ in dims), *(t for _, t in dims)], [])
    return dst


def move(p: Any, n: fx.Node, src: int, shapes: dict[fx.Node, Shape]) -> int | None:
    """``n``'s view (``_view``) copied dense, or None if it needs more than ``DIMS``."""
    a: Any = n.args
    sdims = shapes[a[0]][0]
    view = _view(n, shapes, _tensor_strides(p, src, sdims))
    if view is not None and len(merge(view[0], view[1])) > DIMS:  # a view of a wider value
        src = reshape(p, src, math.prod(sdims[:-1]), sdims[-1])  # dense first
        view = _view(n, shapes)
    if view is None or len(merge(view[0], view[1])) > DIMS:
        return None
    return strided(p, src, *view, shapes[n][0][-1])


def emit(
    p: Any, n: fx.Node, slot: dict[fx.Node, int], value_slot: Any, shapes: dict[fx.Node, Shape]
) -> bool | None:
    """Append ``n``'s instructions (None: not an op of this module's; False: refused)."""
    a: Any = n.args
    if covered(n, shapes) is None:
        return None
    out = shapes[n][0]
    if n.target in (aten.repeat_interleave.self_int, aten.select.int):
        dst = move(p, n, slot[a[0]], shapes)
        if dst is None:
            return False
        slot[n] = dst
        return True
    if n.target == aten.einsum.default:
        done = _emit_einsum(p, n, slot, shapes)
        if done is None:
            return False
        slot[n] = done
        return True
    if n.target == aten.cumsum.default:
        dst = value_slot(n)
        block = 0 if a[1] % len(out) == len(out) - 1 else out[-2]
        p.emit([CUMSUM, dst, slot[a[0]], block], [])
    elif n.target == aten.masked_fill.Scalar:
        dst = value_slot(n)
        p.emit([TRI_FILL, dst, slot[a[0]], out[-2], _mask_offset(n, shapes)], [float(a[2])])
    elif n.target == aten.zeros_like.default:
        dst = value_slot(n)
        p.emit([TRI_FILL, dst, dst, 1, ALL], [0.0])
    else:
        pads = _pads(n, shapes)
        assert pads is not None
        dim, before, after, value = pads
        if not before and not after:
            slot[n] = slot[a[0]]
            return True
        dst = value_slot(n)
        cols = dim == len(out) - 1
        per = 1 if cols else math.prod(out[dim + 1 : -1])
        inner = out[dim] - before - after
        parts = []
        for first, count in ((0, before), (before, inner), (before + inner, after)):
            if cols:
                parts.append(p.view(dst, first, count) if count else None)
            else:
                parts.append(p.row_view(dst, first * per, count * per) if count else None)
        for part in (parts[0], parts[2]):
            if part is not None:
                p.emit([TRI_FILL, part, part, 1, ALL], [value])
        p.emit([COPY, parts[1], slot[a[0]]], [])
    slot[n] = dst
    return True


def _emit_einsum(
    p: Any, n: fx.Node, slot: dict[fx.Node, int], shapes: dict[fx.Node, Shape]
) -> int | None:
    """``STRIDED`` operands, ``FLOAT_MATMUL``, a ``STRIDED`` result (copies only where the
    layout is not already the one the matmul reads or the equation writes)."""
    form = _einsum(n, shapes)
    assert form is not None
    size = form["size"]
    pair: Any = n.args[1]
    x, y = pair

    def operand(node: fx.Node, letters: str, order: list[str], cols: int) -> int | None:
        strides = _tensor_strides(p, slot[node], shapes[node][0])
        sizes = [size[c] for c in order]
        steps = [strides[letters.index(c)] for c in order]
        if len(merge(sizes, steps)) > DIMS:
            return None
        return strided(p, slot[node], sizes, steps, 0, cols)

    batch, m, k, nn = form["batch"], form["m"], form["k"], form["n"]
    kt, nt, mt = (math.prod(size[c] for c in g) for g in (k, nn, m))
    left = operand(x, form["a"], batch + m + k, kt)
    right = operand(y, form["b"], batch + k + nn, nt)
    if left is None or right is None:
        return None
    bt = math.prod(size[c] for c in batch)
    tmp = p.alloc_rows(torch.float32, bt * mt, nt)
    p.emit([FLOAT_MATMUL, tmp, left, right, mt], [])
    order = batch + m + nn
    dense = dense_strides(tuple(size[c] for c in order)) if order else [1]
    out = form["out"]
    sizes = [size[c] for c in out]
    steps = [dense[order.index(c)] for c in out]
    if len(merge(sizes, steps)) > DIMS:
        return None
    return strided(p, tmp, sizes, steps, 0, shapes[n][0][-1])
