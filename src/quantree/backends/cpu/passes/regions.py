"""Runs of small lowered ops fused into one native program (``quantree.program``).

Over 400 lines, on purpose for now: one pass in three phases (shapes, cover, emit) that share
the node -> shape table and the instruction encoding. Its seam is cover (which ops a program
takes) vs emit (the tables): the split waits for the region work in flight to land, so that
the merges stay clean.

At batch 1 a recurrence unrolled in Python (torchaudio's layer-normed LSTM, any cell written
with modules and stepped in a loop) leaves a dozen small ops per step: a quantize, an int8
linear, then float add, layer norm, sigmoid, tanh and mul on a few hundred values each. Every
one costs the interpreter and the dispatcher a few microseconds, more than its arithmetic,
so the lowered model was no faster than float however fast its int8 linears.

After the other rules, this pass takes each maximal run of ops the program instructions
cover (``csrc/qt_program.h``: quantize, dequantize, int8 linear/add/mul/table, float
add/mul/sub (an operand broadcast along rows too), sigmoid/tanh/relu/gelu/silu/neg, layer
norm and RMSNorm over the last dimension, chunk / unbind / getitem / row and column slices /
order-keeping views as views, views and reshapes of dense rows as new views, stack and cat
as copies, and at fixed sizes transposes, permutes and expands as row copies:
``passes/instructions/region_layout.py``; float attention whose q, k, v are heads of ``[B, S, H D]``
values, as an instruction reading them as column blocks: ``passes/attention.program_form``)
and, when it holds at least ``MIN_OPS`` of them, replaces it by one
call. Layer norms and
gelus over many values stay ATen's (``FLOAT_MAX_ELEMENTS``). The arithmetic is each op's
own: the int8 ops the same bits as their kernels, the float ones float32 (layer norm sums
in double; sigmoid/tanh are the recurrent kernels').
What the program computes in float stays float and is reported so (``float_report``).

The program is compiled for the shapes in the graph. A size the graph leaves symbolic (a
dynamic batch) may appear in it as ``a + b * s`` of one symbol ``s`` per program: slots'
rows and offsets and the shapes of inputs and outputs are written so, and the call reads
``s`` from one input's shape, so one program (saved and loaded too) serves every batch size.
Regions with other shapes (two symbols, a symbolic last dimension) are left as they are.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.program)
from quantree.backends.cpu.cells.program import (
    BINARY,
    BINARY_KINDS,
    FLOAT_BINARY,
    FLOAT_BINARY_KINDS,
    FLOAT_UNARY,
    FLOAT_UNARY_KINDS,
    NF,
    NI,
    Program,
    emit,
)
from quantree.backends.cpu.native.loader import cpu_isa
from quantree.backends.cpu.passes.attention import program_form
from quantree.backends.cpu.passes.instructions import region_math, region_strided
from quantree.backends.cpu.passes.instructions.region_layout import (
    MAX_COPIES,
    copies,
    gather,
    reshape,
    row_map,
)
from quantree.backends.cpu.saved.derived import Recipe, remember
from quantree.core.graphs import attr_at, fetch_attr, register_constant
from quantree.core.values import module_scope

aten = torch.ops.aten
quantree_ops = torch.ops.quantree
qd = torch.ops.quantized_decomposed
COPY, LAYER_NORM, RMS_NORM, ATTENTION = 5, 9, 11, 15
MIN_OPS = 8
"""Fewer ops than this gain too little from one call to be worth an opaque node."""
FLOAT_OPS_KEY = "quantree_float_ops"
"""Program node meta: ``(op, node name, module scope)`` of each float op it computes."""
INT8_OPS = {
    quantree_ops.quantize.default,
    quantree_ops.dequantize.default,
    quantree_ops.linear.default,
    quantree_ops.linear16.default,
    quantree_ops.binary.default,
    quantree_ops.lookup.default,
}
VIEWS = {
    aten.chunk.default,
    aten.unbind.int,
    operator.getitem,
    aten.dropout.default,
    *region_strided.SPLITS,
}
SAME_SLOT = {
    aten.alias.default, aten.contiguous.default, aten.clone.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.permute.default, aten.transpose.int,
}  # fmt: skip
"""Ops that keep the last dimension and the row-major order of their input (a permute only
of size-1 dimensions): the same slot, no instruction. Values in a program are never written
after they are made, so a clone needs no copy either."""
RESHAPES = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
}  # fmt: skip
"""Of ``SAME_SLOT``, those that may also change the last dimension
(``passes/instructions/region_layout.py``)."""
PERMUTES = {aten.permute.default, aten.transpose.int}
FLOAT_MAX_ELEMENTS = 12288
"""On paths without vector rows for them (all but AVX-512 and AVX2: ``csrc/program_avx512.cpp``,
``csrc/program_avx2.cpp``, ``float_limit``), layer norm (summing in double) and gelu (libm's
erf/tanh, element by element) are scalar loops in a program: they win on the small tensors programs
are for (an Emformer's 24 x 512, a recurrent step's few hundred values) and lose to ATen's
vectorized kernels on a transformer's activations (GPT-2's 128 x 512 gelus and 128 x 128 layer norms
in programs made the model slower than float; benchmarks/README.md, "Figures moved from
docstrings"). Larger ones stay ATen's there (add/mul/relu loops vectorize, sigmoid/tanh are the
vector kernels'). A dynamic size counts at batch 1. Also the size above which a program marks a
layer norm or gelu for the vector rows (``_vector``)."""
FLOAT_OPS = {aten.layer_norm.default, aten.gelu.default}
VECTOR_ROW_PATHS = frozenset({"avx512vnni", "avxvnni", "avx2"})
"""The kernel paths with vector rows for large layer norms and gelus (csrc/qt_program.h)."""


def float_limit() -> float:
    """The most values a program's layer norm or gelu takes on this machine's kernel path. The
    AVX-512 and AVX2 (and AVX-VNNI) paths run them as vector rows, as fast as ATen's kernels, so
    programs take them at any size there (a BERT layer's residual add, layer norm and gelu then join
    the linears around them in one call). A lowered model saved here and loaded on a path without
    them still runs them, through the scalar loops: slower, the same values up to rounding."""
    return math.inf if cpu_isa() in VECTOR_ROW_PATHS else float(FLOAT_MAX_ELEMENTS)


GELU_KINDS = {"none": 3, "tanh": 4}
"""FLOAT_UNARY kinds of ``aten.gelu`` by its ``approximate`` argument (csrc/qt_program.h)."""
MORE_UNARY = {aten.silu.default: 5, aten.neg.default: 6}
"""FLOAT_UNARY kinds only programs emit (the cells loop's table is ``FLOAT_UNARY_KINDS``):
SwiGLU's ``silu`` (the vector sigmoid times x) and the rotary embedding's ``neg``."""

Dim = Any
"""An ``int``, or a ``sympy`` expression of the graph's size symbols (a dynamic batch)."""
Shape = tuple[tuple[Dim, ...], torch.dtype]


class RegionProgram(Program):
    """A ``Program`` whose slots also record their rows. Rows and byte offsets may be
    expressions of one size symbol (``Dim``); ``_call`` writes them as ``a + b * symbol``."""

    def alloc_rows(self, dtype: torch.dtype, rows: Dim, cols: int) -> int:
        index = len(self.slots)
        self.slots.append([0 if dtype == torch.float32 else 1, index, 0, cols, cols, rows])
        return index

    def view(self, source: int, first_col: int, cols: int) -> int:
        dtype, base, offset, _, ld, rows = self.slots[source]
        elem = 4 if dtype == 0 else 1
        self.slots.append([dtype, base, offset + first_col * elem, cols, ld, rows])
        return len(self.slots) - 1

    def row_view(self, source: int, first_row: Dim, rows: Dim) -> int:
        dtype, base, offset, cols, ld, _ = self.slots[source]
        elem = 4 if dtype == 0 else 1
        self.slots.append([dtype, base, offset + first_row * ld * elem, cols, ld, rows])
        return len(self.slots) - 1


def float_ops_of_code(code: torch.Tensor) -> collections.Counter[str]:
    """The float ops a program's code computes, by aten op name (from the code alone, so a
    loaded ``.pt2`` can be inspected)."""
    names: collections.Counter[str] = collections.Counter()
    binary = {v: k for k, v in FLOAT_BINARY_KINDS.items()}
    unary = {v: k for k, v in FLOAT_UNARY_KINDS.items()}
    more = {v: k.__name__.split(".")[0] for k, v in MORE_UNARY.items()}
    more |= {v: k.__name__.split(".")[0] for k, v in region_math.UNARY_KINDS.items()}
    more[region_math.VECTOR_EXP_KIND] = "exp"
    more[region_math.VECTOR_SOFTPLUS_KIND] = "softplus"
    binary |= {v: k for k, v in region_math.BINARY_KINDS.items()}
    scalar = {v: k.__name__.split(".")[0] for k, v in region_math.SCALAR_KINDS.items()}
    for row in code.reshape(-1, NI).tolist():
        if row[0] == FLOAT_BINARY:
            names[binary[row[4]].__name__.split(".")[0]] += 1
        elif row[0] == FLOAT_UNARY and row[3] in GELU_KINDS.values():
            names["gelu"] += 1
        elif row[0] == FLOAT_UNARY and row[3] in more:
            names[more[row[3]]] += 1
        elif row[0] == FLOAT_UNARY:
            names[unary[row[3]].__name__.split(".")[0]] += 1
        elif row[0] == region_math.FLOAT_SCALAR:
            names[scalar.get(row[3], "rdiv")] += 1
        elif row[0] == region_math.FLOAT_MATMUL:
            names["matmul"] += 1
        elif row[0] == region_math.ROW_SUM:
            names["sum"] += 1
        elif row[0] == region_strided.CUMSUM:
            names["cumsum"] += 1
        elif row[0] == region_strided.TRI_FILL:
            names["masked_fill"] += 1
        elif row[0] == LAYER_NORM:
            names["layer_norm"] += 1
        elif row[0] == RMS_NORM:
            names["rms_norm"] += 1
        elif row[0] == ATTENTION:
            names["attention"] += 1
    return names


def fuse_regions(
    gm: fx.GraphModule, min_ops: int = MIN_OPS, math: bool = False, small_math: bool = True
) -> int:
    """Replace each run of at least ``min_ops`` program-covered ops of ``gm`` by one
    ``quantree.program`` call; returns how many were replaced. Programs take
    ``region_math``'s and ``region_strided``'s ops too. ``math``: ``gm`` is a folded loop's
    step (``cells/step_program.py``), whose program must be the whole step; else a whole
    model, whose regions end at their last computing op (``_trim``, a trailing ``contiguous``
    kept) and whose math ops join programs only with ``small_math``, up to
    ``region_strided.MAX_ELEMENTS`` values and never as int8 matmuls (ATen's vectorized
    kernels and the int8 matmul's own call win on large ones; on small ones a call costs more
    than its arithmetic: xLSTM's chunkwise-parallel part, benchmarks/README.md, h-xlstm64)."""
    top, math = not math, True
    shapes = _infer_shapes(gm, math)
    fused = 0
    regions = _regions(gm, shapes, math, top, top and not small_math)
    for region in regions:
        if top:
            _trim(region, dense=True)
        if sum(1 for n in region if _computes(n)) >= min_ops and _replace(gm, region, shapes, math):
            fused += 1
    if fused or regions:  # a region refused late may have left constants behind
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return fused


def _slice_shape(src: Shape, args: tuple[Any, ...]) -> Shape | None:
    """``aten.slice.Tensor(x, dim, start, end, step)``'s shape from ``x``'s, where the
    sliced size and the bounds are integers (else unknown: the op stays out of programs)."""
    dims, dtype = src
    defaults = (0, None, None, 1)
    dim, start, end, step = (*args, *defaults[len(args) :])[:4]
    if not isinstance(dim, int) or not dims:
        return None
    d = dim % len(dims)
    size = dims[d]
    if type(size) is not int or not all(v is None or type(v) is int for v in (start, end, step)):
        return None
    length = len(range(size)[slice(start, end, step)])
    return ((*dims[:d], length, *dims[d + 1 :]), dtype)


def _infer_shapes(gm: fx.GraphModule, math: bool = False) -> dict[fx.Node, Shape]:
    """Shape and dtype of every single-tensor value: the graph's own ``val`` metadata, and
    for the lowering's int8 ops (which have none) what they compute."""
    shapes: dict[fx.Node, Shape] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "get_attr":
            val = attr_at(gm, str(n.target))
        a: Any = n.args
        dims = _dims(val) if isinstance(val, torch.Tensor) else None
        if dims is not None:
            shapes[n] = (dims, val.dtype)
        if n.target == aten.cat.default and n not in shapes:  # an int8 cat (lowering_cat)
            cat_shape = _cat_shape([shapes.get(x) for x in a[0]], _cat_dim(n))
            if cat_shape is not None:
                shapes[n] = cat_shape
        if n.target == aten.slice.Tensor and n not in shapes and a[0] in shapes:
            sliced = _slice_shape(shapes[a[0]], a[1:])  # an int8 slice (lowering_qdq, _views)
            if sliced is not None:
                shapes[n] = sliced
        if n.target in INT8_OPS and n not in shapes:
            source = a[1] if n.target == quantree_ops.binary.default else a[0]
            binary = n.target == quantree_ops.binary.default
            if binary and source in shapes and a[2] in shapes and _numel(shapes[source][0]) == 1:
                source = a[2]  # a one-element first operand, broadcast
            if source not in shapes:
                continue
            shape = shapes[source][0]
            if binary and a[2] in shapes and _numel(shapes[a[2]][0]) != 1:
                both = _broadcast_dims(shape, shapes[a[2]][0])  # an outer product's operands
                if both is None:
                    continue
                shape = both
            if n.target == quantree_ops.quantize.default:
                shapes[n] = (shape, torch.int8)
            elif n.target == quantree_ops.dequantize.default:
                shapes[n] = (shape, torch.float32)
            elif n.target == quantree_ops.linear.default:
                dtype = torch.int8 if a[6] > 0 else torch.float32
                shapes[n] = ((*shape[:-1], int(a[5])), dtype)
            elif n.target == quantree_ops.linear16.default:
                shapes[n] = ((*shape[:-1], int(a[8])), torch.float32)
            else:
                shapes[n] = (shape, torch.int8)
        region_math.infer(n, shapes, math)
    return shapes


def _broadcast_dims(sa: tuple[Dim, ...], sb: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """What broadcasting ``sa`` against ``sb`` makes (None: sizes that do not broadcast, or
    symbolic sizes not known equal)."""
    width = max(len(sa), len(sb))
    sa, sb = (1,) * (width - len(sa)) + tuple(sa), (1,) * (width - len(sb)) + tuple(sb)
    out: list[Dim] = []
    for x, y in zip(sa, sb, strict=True):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


def _cat_shape(parts: list[Shape | None], dim: int) -> Shape | None:
    """What a cat of ``parts`` along ``dim`` makes (None: a part unknown or unlike)."""
    known = [x for x in parts if x is not None]
    if not known or len(known) != len(parts) or not known[0][0]:
        return None
    rank, dtype = len(known[0][0]), known[0][1]
    if any(len(x[0]) != rank or x[1] != dtype for x in known):
        return None
    dim %= rank
    shape = list(known[0][0])
    shape[dim] = _numel((sum(x[0][dim] for x in known),))
    return tuple(shape), dtype


def _dims(val: torch.Tensor) -> tuple[Dim, ...] | None:
    """``val``'s shape with each symbolic size as its ``sympy`` expression; None unless the
    last dimension is fixed (it is a slot's columns) and the rest are linear in at most one
    size symbol (a program resolves one symbol per call)."""
    dims: list[Dim] = []
    for d in val.shape:
        if isinstance(d, int):
            dims.append(d)
            continue
        expr = sympy.expand(d.node.expr)
        dims.append(int(expr) if expr.is_Integer else expr)
    if dims and not isinstance(dims[-1], int):
        return None
    symbols = set().union(*(sympy.sympify(d).free_symbols for d in dims)) if dims else set()
    if len(symbols) > 1 or any(_linear(d) is None for d in dims):
        return None
    return tuple(dims)


def _linear(d: Dim) -> tuple[int, int] | None:
    """``d`` as ``(a, b)`` with ``d = a + b * symbol`` (integers), or None."""
    expr = sympy.expand(sympy.sympify(d))
    symbols = list(expr.free_symbols)
    if not symbols:
        return (int(expr), 0) if expr.is_Integer else None
    (sym,) = symbols
    if not expr.is_polynomial(sym):  # FloorDiv, Mod, ...: not linear (and 0 may divide)
        return None
    a, b = expr.subs(sym, 0), sympy.diff(expr, sym)
    return (int(a), int(b)) if a.is_Integer and b.is_Integer else None


def _cols(shape: Shape) -> int:
    return int(shape[0][-1]) if shape[0] else 1


def _rows(shape: Shape) -> Dim:
    return _numel(shape[0][:-1])


def _computes(n: fx.Node) -> bool:
    """Whether ``n`` is an instruction, not a view the program takes for free."""
    return n.target not in VIEWS and n.target not in SAME_SLOT and n.target != aten.slice.Tensor


def _numel(shape: tuple[Dim, ...]) -> Dim:
    total: Dim = 1
    for d in shape:
        total *= d
    return sympy.expand(total) if isinstance(total, sympy.Expr) else total


def _keeps_rows(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool:
    """A ``SAME_SLOT`` op: same last dimension, same elements in the same order."""
    a: Any = n.args
    src, out = shapes.get(a[0]), shapes.get(n)
    if src is None or out is None or not src[0] or not out[0] or src[1] != out[1]:
        return False
    if src[0][-1] != out[0][-1] or _numel(src[0]) != _numel(out[0]):
        return False
    if n.target in (aten.permute.default, aten.transpose.int):
        rank = len(src[0])
        if n.target == aten.transpose.int:
            perm = list(range(rank))
            d0, d1 = a[1] % rank, a[2] % rank
            perm[d0], perm[d1] = perm[d1], perm[d0]
        else:
            perm = [d % rank for d in a[1]]
        moved = [d for d in perm if src[0][d] != 1]
        return moved == sorted(moved) and perm[-1] == rank - 1
    return True


def _axis(shape: tuple[int, ...], dim: int) -> str | None:
    """How a slice or cat along ``dim`` of ``shape`` maps onto [rows, cols]: "cols" along
    the last dimension, "rows" where every dimension before ``dim`` is 1, else None."""
    if not shape:
        return None
    dim %= len(shape)
    if dim == len(shape) - 1:
        return "cols"
    return "rows" if _numel(shape[:dim]) == 1 else None


def _bounds(size: int, start: object, end: object) -> tuple[int, int]:
    lo = 0 if start is None else int(start)  # type: ignore[call-overload]
    hi = size if end is None else int(end)  # type: ignore[call-overload]
    lo, hi = (lo + size if lo < 0 else lo), (hi + size if hi < 0 else hi)
    lo, hi = min(max(lo, 0), size), min(max(hi, 0), size)
    return lo, max(lo, hi)


def _vector(n: fx.Node, shapes: dict[fx.Node, Shape]) -> int:
    """1 if the layer norm or gelu ``n`` is one only the vector rows' paths take (more
    values than the scalar loops win on): the instruction's flag for those rows. Smaller
    ones keep the scalar loops, the same bits on every path as before."""
    return int(_float_size(shapes[n]) > FLOAT_MAX_ELEMENTS)


def _float_size(shape: Shape) -> int:
    """Elements of a float op's output, a symbolic size taken as 1."""
    numel = _numel(shape[0])
    if isinstance(numel, sympy.Expr):
        numel = numel.subs({sym: 1 for sym in numel.free_symbols})
    return int(numel)


def _cat_dim(n: fx.Node) -> int:
    a: Any = n.args
    dim: Any = a[1] if len(a) > 1 else n.kwargs.get("dim", 0)
    return int(dim)


def _gelu_kind(n: fx.Node) -> int | None:
    a: Any = n.args
    return GELU_KINDS.get(str(n.kwargs.get("approximate", a[1] if len(a) > 1 else "none")))


def _cat_parts(n: fx.Node, shapes: dict[fx.Node, Shape]) -> list[fx.Node] | None:
    """The parts of a ``cat`` that hold elements (legacy empty 1-d ones are skipped), or None
    if one is not a value the program can read."""
    parts = []
    for x in n.args[0]:  # type: ignore[union-attr]
        shape = shapes.get(x) if isinstance(x, fx.Node) else None
        if shape is None:
            return None
        if _numel(shape[0]) == 0 and len(shape[0]) == 1:
            continue
        if x.op == "get_attr" or shape[1] != shapes[n][1] or len(shape[0]) != len(shapes[n][0]):  # type: ignore[union-attr]
            return None
        parts.append(x)
    return parts  # type: ignore[return-value]


def _covered(
    n: fx.Node,
    shapes: dict[fx.Node, Shape],
    inside: set[fx.Node],
    math: bool = False,
    top: bool = False,
    no_math: bool = False,
) -> bool:
    """Whether the program runs ``n`` (its shapes known, its arguments of the right kind)."""
    a: Any = n.args
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return a[0] in inside and a[0].target in (
            aten.chunk.default,
            aten.unbind.int,
            *region_strided.SPLITS,
        )
    if n.target == aten.chunk.default:
        src = shapes.get(a[0])
        dim = a[2] if len(a) > 2 else 0
        return (
            src is not None
            and len(src[0]) >= 1
            and dim in (-1, len(src[0]) - 1)
            and src[0][-1] % a[1] == 0
        )
    if n.target in region_strided.SPLITS:
        return math and _split_pieces(n, shapes) is not None
    if n.target == aten.unbind.int:
        src = shapes.get(a[0])
        dim = a[1] if len(a) > 1 else n.kwargs.get("dim", 0)
        return bool(src is not None and len(src[0]) >= 2 and dim == 0 and type(src[0][0]) is int)
    if n.target == aten.dropout.default:
        return bool(a[0] in shapes and (len(a) < 3 or a[2] is False or a[1] == 0))
    if n.target == quantree_ops.attention.default:
        return program_form(n, shapes, inside) is not None
    if n.target in PERMUTES and a[0] in inside and a[0].target == quantree_ops.attention.default:
        return True  # the heads merged back: the ATTENTION instruction's rows, as they are
    if n not in shapes or shapes[n][1] not in (torch.float32, torch.int8):
        return False
    if math and (known := region_math.covered(n, shapes)) is not None:
        return known and not (top and (no_math or _large(n, shapes)))
    if math and (known := region_strided.covered(n, shapes)) is not None:
        return known and not no_math
    if n.target in SAME_SLOT:
        if not isinstance(a[0], fx.Node) or n.kwargs or a[0] not in shapes:
            return False
        if _keeps_rows(n, shapes):
            return True
        if n.target in RESHAPES or (math and n.target in region_strided.SQUEEZES):
            src, out = shapes[a[0]], shapes[n]
            return bool(src[1] == out[1] and src[0] and out[0] and _numel(src[0]) == _numel(out[0]))
        if n.target in PERMUTES and _moved_rows(n, shapes) is not None:
            return True
        return math and n.target in PERMUTES and region_strided.moves(n, shapes)
    if n.target == aten.expand.default:
        if n.kwargs or a[0] not in shapes:
            return False
        return _moved_rows(n, shapes) is not None or (math and region_strided.moves(n, shapes))
    if n.target == aten.slice.Tensor:
        src = shapes.get(a[0])
        step = a[4] if len(a) > 4 else 1
        dim = a[1] if len(a) > 1 else 0
        return bool(
            src is not None
            and step == 1
            and _axis(src[0], dim) is not None
            and type(src[0][dim % len(src[0])]) is int  # a slice of a symbolic size: no
        )
    if n.target == aten.cat.default:
        parts = _cat_parts(n, shapes)
        return bool(parts and _axis(shapes[n][0], _cat_dim(n)) is not None)
    if n.target in FLOAT_OPS and _float_size(shapes[n]) > float_limit():
        return False
    if n.target == aten.gelu.default:
        return (
            _gelu_kind(n) is not None
            and shapes.get(a[0]) == shapes[n]
            and shapes[n][1] == torch.float32
        )
    if n.target == aten.stack.default:
        dim = a[1] if len(a) > 1 else n.kwargs.get("dim", 0)
        items = a[0]
        return bool(
            dim == 0
            and len(items) > 0
            and all(shapes.get(x) == shapes.get(items[0]) for x in items)
            and items[0] in shapes
            and len(shapes[items[0]][0]) >= 1
        )
    if n.target in MORE_UNARY:
        return shapes.get(a[0]) == shapes[n] and shapes[n][1] == torch.float32 and not n.kwargs
    if n.target == aten.rms_norm.default:
        weight = a[2] if len(a) > 2 else None
        return (
            list(a[1]) == [_cols(shapes[n])]
            and (weight is None or (isinstance(weight, fx.Node) and weight.op == "get_attr"))
            and shapes[n][1] == torch.float32
            and shapes.get(a[0]) == shapes[n]
            and not n.kwargs
        )
    if n.target == aten.layer_norm.default:
        weight = a[2] if len(a) > 2 else None
        bias = a[3] if len(a) > 3 else None
        consts = all(
            w is None or (isinstance(w, fx.Node) and w.op == "get_attr") for w in (weight, bias)
        )
        return (
            list(a[1]) == [_cols(shapes[n])]
            and consts
            and shapes[n][1] == torch.float32
            and len(shapes[n][0]) >= 1
        )
    if n.target in FLOAT_BINARY_KINDS:
        return (
            not n.kwargs
            and len(a) == 2
            and all(isinstance(x, fx.Node) for x in a)
            and all(
                _one_float(shapes.get(x))
                or (x in shapes and _spreads(shapes[x], shapes[n], math))
                or _broadcasts(shapes.get(x), shapes[n])
                for x in a
            )
            and shapes[n][1] == torch.float32
        )
    if n.target in FLOAT_UNARY_KINDS:
        return shapes.get(a[0]) == shapes[n] and shapes[n][1] == torch.float32
    if n.target in INT8_OPS:
        if n.target == quantree_ops.binary.default:
            one = [_numel(shapes[x][0]) == 1 for x in a[1:3] if x in shapes]
            if len(one) == 2 and one != [True, True] and True in one:  # a one-element operand
                big = a[1] if one[1] else a[2]
                scalar_first = one[0] and a[0] not in ("add", "mul")
                ok = shapes[big] == (shapes[n][0], torch.int8) and not scalar_first
                return ok and all(shapes[x][1] == torch.int8 for x in a[1:3])
            if _int8_broadcast(n, shapes, math):
                return a[0] in BINARY_KINDS
            return shapes.get(a[1]) == shapes.get(a[2]) == (shapes[n][0], torch.int8)
        if n.target == quantree_ops.linear16.default:
            return len(a) == 9 and shapes.get(a[0], ((), None))[1] == torch.float32
        return not (n.target == quantree_ops.linear.default and len(a) != 9)
    return False


def _split_pieces(n: fx.Node, shapes: dict[fx.Node, Shape]) -> list[tuple[int, int]] | None:
    """``split_with_sizes`` / ``tensor_split`` at fixed sizes along the columns or whole rows
    (``_axis``): each piece's first index and size along that dimension (None: another)."""
    a: Any = n.args
    src = shapes.get(a[0])
    dim = a[2] if len(a) > 2 else n.kwargs.get("dim", 0)
    if src is None or not src[0] or not isinstance(dim, int) or not isinstance(a[1], (list, tuple)):
        return None
    dims = src[0]
    dim %= len(dims)
    if (
        type(dims[dim]) is not int
        or _axis(dims, dim) is None
        or not all(type(x) is int for x in a[1])
    ):
        return None
    size = dims[dim]
    if n.target == aten.split_with_sizes.default:
        if sum(a[1]) != size or min(a[1], default=0) < 0:
            return None
        starts = [sum(a[1][:i]) for i in range(len(a[1]))]
        return list(zip(starts, a[1], strict=True))
    cuts = [0, *(min(max(x + size if x < 0 else x, 0), size) for x in a[1]), size]
    return [(lo, max(hi - lo, 0)) for lo, hi in itertools.pairwise(cuts)]


def _split_views(
    p: RegionProgram, n: fx.Node, source: int, shapes: dict[fx.Node, Shape]
) -> list[int]:
    """The pieces of a split (``_split_pieces``) as views of ``source``."""
    a: Any = n.args
    dims = shapes[a[0]][0]
    dim: Any = a[2] if len(a) > 2 else n.kwargs.get("dim", 0)
    dim %= len(dims)
    pieces = _split_pieces(n, shapes)
    assert pieces is not None
    if _axis(dims, dim) == "cols":
        return [p.view(source, lo, count) for lo, count in pieces]
    per = _numel(dims[dim + 1 : -1])
    return [p.row_view(source, lo * per, count * per) for lo, count in pieces]


def _large(n: fx.Node, shapes: dict[fx.Node, Shape]) -> bool:
    """A math op a whole model's program leaves to ATen (``fuse_regions``' ``top``): an int8
    matmul, or one reading or making more than ``region_strided.MAX_ELEMENTS`` values."""
    if n.target == quantree_ops.matmul.default:
        return True
    values = [shapes.get(x) for x in (n, *n.all_input_nodes)]
    return any(v is None or _float_size(v) > region_strided.MAX_ELEMENTS for v in values)


def _moved_rows(n: fx.Node, shapes: dict[fx.Node, Shape]) -> list[tuple[int, int]] | None:
    """A permute's or an expand's output rows as source row strides
    (``passes/instructions/region_layout.py``)."""
    a: Any = n.args
    src, out = shapes[a[0]][0], shapes[n][0]
    perm: list[int] | None = None
    if n.target == aten.transpose.int:
        perm = list(range(len(src)))
        d0, d1 = a[1] % len(src), a[2] % len(src)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    elif n.target == aten.permute.default:
        perm = list(a[1])
    dims = row_map(src, out, perm)
    return dims if dims is not None and copies(dims) <= MAX_COPIES else None


def _broadcasts(shape: Shape | None, out: Shape) -> bool:
    """``shape`` is ``out``'s, or a float32 one that broadcasts to it along rows, or along
    columns (one value per row: ``FLOAT_BINARY``'s column flag)."""
    if shape is None or shape == out:
        return shape is not None
    if region_math.column(shape, out):
        return True
    dims = row_map(shape[0], out[0], None)
    return shape[1] == out[1] and dims is not None and copies(dims) <= MAX_COPIES


def _one_float(shape: Shape | None) -> bool:
    """A one-element float32 operand (SpeechBrain's eval-mode ``[1]`` drop mask in a folded
    step), read as one value for every element (``FLOAT_BINARY``'s flags 3 and 4)."""
    return shape is not None and shape[1] == torch.float32 and _numel(shape[0]) == 1


def _int8_broadcast(n: fx.Node, shapes: dict[fx.Node, Shape], math: bool = False) -> bool:
    """An int8 binary whose operands broadcast to its result along rows or as a column (an
    outer product moved into a folded step), neither of them one element (``BINARY``'s
    flag 1, ``cells/program.emit``)."""
    a: Any = n.args
    out = (shapes[n][0], torch.int8)
    ins = [shapes.get(x) for x in a[1:3]]
    return (
        shapes[n][1] == torch.int8
        and any(s != out for s in ins)
        and all(s is not None and _numel(s[0]) != 1 and _spreads(s, out, math) for s in ins)
    )


def _spreads(s: Shape, out: Shape, math: bool) -> bool:
    """``_broadcasts``, or in a folded step's program (``math``) a block column too."""
    return _broadcasts(s, out) or (math and region_math.block_column(s, out) is not None)


def _trim(region: list[fx.Node], dense: bool = False) -> None:
    """Drops the region's trailing views, slices, unbinds and transposes: only readers
    outside it use them (the last node of a run has no reader inside), and there they are
    views or strided reads, where inside they are row copies and then output copies (the
    heads of BERT's joined q/k/v linear, which the attention call reads through their
    strides; ViT's q, k, v unbound from one permuted tensor). Not in a folded step's program
    (``math``), which must be the whole step. ``dense``: a trailing ``contiguous`` stays
    (its reader outside wants the dense copy the program writes anyway)."""
    moves = SAME_SLOT | VIEWS | {aten.slice.Tensor, quantree_ops.attention.default}
    if dense:  # a dense copy read outside (a folded loop's input): the program writes it
        moves = moves - {aten.contiguous.default}
    while region and region[-1].target in moves:
        region.pop()


def _regions(
    gm: fx.GraphModule,
    shapes: dict[fx.Node, Shape],
    math: bool = False,
    top: bool = False,
    no_math: bool = False,
) -> list[list[fx.Node]]:
    """Maximal runs of covered nodes, in graph order. A run ends where an uncovered node reads
    one of its values, so that the one call, placed at the run's end, comes before every
    reader outside it and after every value it reads."""
    regions: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    inside: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if _covered(n, shapes, inside, math, top, no_math):
            current.append(n)
            inside.add(n)
        elif any(x in inside for x in n.all_input_nodes) or n.op == "output":
            if current:
                regions.append(current)
            current, inside = [], set()
    if current:
        regions.append(current)
    return regions


def _replace(
    gm: fx.GraphModule,
    region: list[fx.Node],
    shapes: dict[fx.Node, Shape],
    math: bool = False,
) -> bool:
    """Compile ``region`` and put the program call in its place (False: left as it was)."""
    inside = set(region)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    if any(
        n.target in (aten.chunk.default, aten.unbind.int, *region_strided.SPLITS) for n in outputs
    ):
        return False  # a tuple read outside: keep the region's views inside it
    p = RegionProgram()
    slot: dict[fx.Node, int] = {}
    inputs: list[fx.Node] = []
    const_nodes: list[fx.Node] = []
    const_of: dict[fx.Node, int] = {}
    pieces: dict[fx.Node, list[int]] = {}

    def value_slot(n: fx.Node) -> int | None:
        shape = shapes.get(n)
        return None if shape is None else p.alloc_rows(shape[1], _rows(shape), _cols(shape))

    def const_index(n: object) -> int:
        if n is None:
            return -1
        assert isinstance(n, fx.Node) and n.op == "get_attr"
        if n not in const_of:
            const_of[n] = len(p.consts)
            p.consts.append(fetch_attr(gm, str(n.target)))
            const_nodes.append(n)
        return const_of[n]

    def operand(x: object, constant: bool = False) -> bool:
        """Give an outside value read by the region an input slot (a constant only if
        ``constant``: a broadcast operand; other constants are the instructions')."""
        if not isinstance(x, fx.Node) or x in slot or x in pieces:
            return True
        if x.op == "get_attr" and not constant:
            return True
        if x in inside or x not in shapes or shapes[x][1] not in (torch.float32, torch.int8):
            return x in slot
        s = value_slot(x)
        if s is None:
            return False
        slot[x] = s
        inputs.append(x)
        return True

    float_ops: list[tuple[str, str, str]] = []
    found = [(n, program_form(n, shapes, inside)) for n in region]
    forms = {n: form for n, form in found if form is not None}
    if len(forms) != sum(1 for n in region if n.target == quantree_ops.attention.default):
        return False
    heads = {x for form in forms.values() for x in form["splits"]}
    for n in region:
        a: Any = n.args
        if n in heads:  # q, k and v's heads: column blocks the ATTENTION instruction reads
            continue
        if n in forms:
            if not _attention(p, n, forms[n], slot, operand):
                return False
            float_ops.append((str(n.target), n.name, module_scope(n)))
            continue
        if n.target in PERMUTES and a[0] in forms:
            form = forms[a[0]]
            slot[n] = p.row_view(slot[a[0]], 0, form["batch"] * form["sq"] * form["heads"])
            p.slots[slot[n]][3] = p.slots[slot[n]][4] = form["dv"]
            continue
        if n.target == aten.stack.default:
            reads = a[0]
        elif n.target == aten.cat.default:
            parts = _cat_parts(n, shapes)
            if parts is None:  # a part from a region replaced since: its shape unknown
                return False
            reads = parts
        else:
            reads = n.all_input_nodes
        if n.target in FLOAT_BINARY_KINDS:
            if not all(operand(x, constant=True) for x in reads):
                return False
        elif not all(
            operand(x) for x in reads if not (isinstance(x, fx.Node) and x.op == "get_attr")
        ):
            return False
        if n.target == aten.chunk.default:
            width = p.slots[slot[a[0]]][3] // a[1]
            pieces[n] = [p.view(slot[a[0]], i * width, width) for i in range(a[1])]
        elif n.target == aten.unbind.int:
            count = shapes[a[0]][0][0]
            rows = _numel(shapes[a[0]][0][1:-1])
            pieces[n] = [p.row_view(slot[a[0]], i * rows, rows) for i in range(count)]
        elif n.target in region_strided.SPLITS:
            pieces[n] = _split_views(p, n, slot[a[0]], shapes)
        elif n.target is operator.getitem:
            slot[n] = pieces[a[0]][a[1]]
        elif math and region_math.swaps_last(n, shapes):  # a TRANSPOSE, not a row move
            if not region_math.emit(p, n, slot, value_slot, shapes):
                return False
        elif (n.target in SAME_SLOT or n.target == aten.expand.default) and not (
            n.target != aten.expand.default and _keeps_rows(n, shapes)
        ):
            moved = None if n.target in RESHAPES else _moved_rows(n, shapes)
            if n.target in RESHAPES or (math and n.target in region_strided.SQUEEZES):
                slot[n] = reshape(p, slot[a[0]], _rows(shapes[n]), _cols(shapes[n]))
            elif moved is not None:
                slot[n] = gather(p, slot[a[0]], moved)
            else:  # the last dimension moves or spreads: a strided copy
                done = region_strided.move(p, n, slot[a[0]], shapes) if math else None
                if done is None:
                    return False
                slot[n] = done
        elif n.target == aten.dropout.default or n.target in SAME_SLOT:
            slot[n] = slot[a[0]]
        elif (
            n.target in FLOAT_BINARY_KINDS
            and all(isinstance(x, fx.Node) for x in a)
            and any(shapes[x] != shapes[n] for x in a)
        ):
            sources, flag = [], 0
            for i, x in enumerate(a):
                if shapes[x] == shapes[n] or region_math.column(shapes[x], shapes[n]):
                    flag = flag or (2 - i if shapes[x] != shapes[n] else 0)
                    sources.append(slot[x])
                    continue
                if _one_float(shapes[x]):  # one value for every row (flag 3: b, 4: a)
                    flag = 4 - i
                    sources.append(slot[x])
                    continue
                block = region_math.block_column(shapes[x], shapes[n]) if math else None
                if block is not None:  # copied out to a column: one value per row
                    flag = 2 - i
                    sources.append(gather(p, slot[x], block))
                    continue
                dims = row_map(shapes[x][0], shapes[n][0], None)
                if dims is None:
                    return False
                sources.append(gather(p, slot[x], dims))
            dst = value_slot(n)
            assert dst is not None
            p.emit([FLOAT_BINARY, dst, *sources, FLOAT_BINARY_KINDS[n.target], flag], [])
            slot[n] = dst
        elif n.target == quantree_ops.binary.default and _int8_broadcast(n, shapes, math):
            sources, flag = [], 0
            for i, x in enumerate(a[1:3]):
                dims = row_map(shapes[x][0], shapes[n][0], None)
                block = region_math.block_column(shapes[x], shapes[n]) if math else None
                if region_math.column(shapes[x], shapes[n]):
                    flag, source = 3 - i, slot[x]  # BINARY's flag: a (3) or b (2) a column
                elif shapes[x] == shapes[n]:
                    source = slot[x]
                elif dims is not None:
                    source = gather(p, slot[x], dims)
                elif block is not None:  # copied out to a column first
                    flag, source = 3 - i, gather(p, slot[x], block)
                else:
                    return False
                sources.append(source)
            dst = value_slot(n)
            assert dst is not None
            ints = [BINARY, dst, *sources, BINARY_KINDS[a[0]], flag]
            p.emit(ints, [float(g) for g in a[3:7]] + [1.0 / a[7], float(a[8])])
            slot[n] = dst
        elif n.target == aten.slice.Tensor:
            shape = shapes[a[0]][0]
            dim = (a[1] if len(a) > 1 else 0) % len(shape)
            lo, hi = _bounds(shape[dim], a[2] if len(a) > 2 else None, a[3] if len(a) > 3 else None)
            if _axis(shape, dim) == "cols":
                slot[n] = p.view(slot[a[0]], lo, hi - lo)
            else:
                per = _numel(shape[dim + 1 : -1])
                slot[n] = p.row_view(slot[a[0]], lo * per, (hi - lo) * per)
        elif n.target == aten.cat.default:
            dst = value_slot(n)
            assert dst is not None
            along = _axis(shapes[n][0], _cat_dim(n))
            at = 0
            for x in _cat_parts(n, shapes) or []:
                _, _, _, cols, _, rows = p.slots[slot[x]]
                if along == "cols":
                    part, at = p.view(dst, at, cols), at + cols
                else:
                    part, at = p.row_view(dst, at, rows), at + rows
                p.emit([COPY, part, slot[x]], [])
            slot[n] = dst
        elif n.target == aten.gelu.default:
            dst = value_slot(n)
            assert dst is not None
            kind = _gelu_kind(n)
            assert kind is not None
            p.emit([FLOAT_UNARY, dst, slot[a[0]], kind, _vector(n, shapes)], [])
            slot[n] = dst
        elif n.target == aten.stack.default:
            dst = value_slot(n)
            assert dst is not None
            rows = p.slots[slot[a[0][0]]][5]
            for i, x in enumerate(a[0]):
                part = p.row_view(dst, i * rows, rows)
                p.emit([COPY, part, slot[x]], [])
            slot[n] = dst
        elif n.target in MORE_UNARY:
            dst = value_slot(n)
            assert dst is not None
            p.emit([FLOAT_UNARY, dst, slot[a[0]], MORE_UNARY[n.target]], [])
            slot[n] = dst
        elif n.target == aten.rms_norm.default:
            dst = value_slot(n)
            assert dst is not None
            weight = const_index(a[2] if len(a) > 2 else None)
            eps = a[3] if len(a) > 3 and a[3] is not None else torch.finfo(torch.float32).eps
            p.emit([RMS_NORM, dst, slot[a[0]], weight], [float(eps)])
            slot[n] = dst
        elif n.target == aten.layer_norm.default:
            dst = value_slot(n)
            assert dst is not None
            weight = const_index(a[2] if len(a) > 2 else None)
            bias = const_index(a[3] if len(a) > 3 else None)
            eps = float(a[4]) if len(a) > 4 else 1e-5
            p.emit([LAYER_NORM, dst, slot[a[0]], weight, bias, _vector(n, shapes)], [eps])
            slot[n] = dst
        elif math and (
            (done := region_strided.emit(p, n, slot, value_slot, shapes)) is not None
            or (done := region_math.emit(p, n, slot, value_slot, shapes)) is not None
        ):
            if not done:
                return False
        elif not emit(p, n, slot, value_slot, const_index):
            return False
        elif n.target == quantree_ops.linear.default and float(a[6]) > 0:
            _requantization(gm, p, const_nodes, a, region[0])
        moves = (aten.stack.default, aten.cat.default, aten.expand.default)
        int8 = n.target in INT8_OPS or n.target == quantree_ops.matmul.default
        if not int8 and _computes(n) and n.target not in moves:
            float_ops.append((str(n.target), n.name, module_scope(n)))
    for n in outputs:
        operand(n)
    return _call(gm, region, p, inputs, const_nodes, outputs, slot, shapes, float_ops)


def _attention(p: RegionProgram, n: fx.Node, form: dict[str, Any], slot: dict[fx.Node, int],
               operand: Any) -> bool:  # fmt: skip
    """Emit ``ATTENTION`` for ``n`` (``passes/attention.program_form``): its result a new
    ``[B Sq, H Dv]`` slot, which the transpose after it reads as ``[B Sq H, Dv]`` rows."""
    mask = form["mask"]
    if not all(operand(form[x]) for x in ("q", "k", "v")):
        return False
    if mask is not None and not operand(mask, constant=True):
        return False
    rows = form["batch"] * form["sq"]
    dst = p.alloc_rows(torch.float32, rows, form["heads"] * form["dv"])
    ints = [ATTENTION, dst, slot[form["q"]], slot[form["k"]], slot[form["v"]]]
    ints += [-1 if mask is None else slot[mask], form["heads"], form["sq"], form["sk"]]
    ints += [max(form["mode"], 0), form["d"], form["dv"]]
    p.emit(ints, [form["scale"]])
    slot[n] = dst
    return True


def _requantization(
    gm: fx.GraphModule, p: RegionProgram, const_nodes: list[fx.Node], a: Any, first: fx.Node
) -> None:
    """An int8-output linear's multipliers, ``scale / out_scale`` then ``bias / out_scale``
    (float32, as ``qt_cell_loop`` computes them), as one constant the instruction reads."""
    code = p.code[-1]
    scale = p.consts[code[4]]
    bias = p.consts[code[5]] if code[5] >= 0 else torch.zeros_like(scale)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(a[6]), dtype=torch.float32)
    value = torch.cat([scale.float() * inv, bias.float() * inv]).contiguous()
    # per call site (its scale and output grid): saved as the recipe on what it derives from
    bias_arg = p.consts[code[5]] if code[5] >= 0 else None
    remember(value, Recipe(quantree_ops.derived_requant.default, (scale, bias_arg, float(a[6]))))
    name = register_constant(gm, "_cpu_requant_", value)
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(name)
    code[11] = len(p.consts)
    p.consts.append(value)
    const_nodes.append(node)


def _call(
    gm: fx.GraphModule,
    region: list[fx.Node],
    p: RegionProgram,
    inputs: list[fx.Node],
    const_nodes: list[fx.Node],
    outputs: list[fx.Node],
    slot: dict[fx.Node, int],
    shapes: dict[fx.Node, Shape],
    float_ops: list[tuple[str, str, str]],
) -> bool:
    """Put the call in; False (nothing changed) if its sizes need more than one symbol."""
    graph = gm.graph
    symbolic = _symbolic(p, inputs, shapes)
    if symbolic is None:
        return False
    slots, binding = symbolic
    tables = {
        "code": torch.tensor(p.code, dtype=torch.int64).reshape(-1, NI),
        "fcode": torch.tensor(p.fcode, dtype=torch.float32).reshape(-1, NF),
        "slots": torch.tensor(slots, dtype=torch.int64).reshape(len(slots), -1),
        "in": torch.tensor([slot[x] for x in inputs], dtype=torch.int64),
        "out": torch.tensor([slot[x] for x in outputs], dtype=torch.int64),
    }
    with graph.inserting_before(region[0]):
        attrs = {
            k: graph.get_attr(register_constant(gm, f"_cpu_program_{k}_", v))
            for k, v in tables.items()
        }
    in_dims = [_linear(d) or (0, 0) for x in inputs for d in shapes[x][0]]
    out_dims = [_linear(d) or (0, 0) for x in outputs for d in shapes[x][0]]
    in_shapes, out_shapes = [a for a, _ in in_dims], [a for a, _ in out_dims]
    sizes = (  # the symbol's coefficients and where to read it, for a dynamic program only
        ([b for _, b in in_dims], [b for _, b in out_dims], binding) if binding else ()
    )
    with graph.inserting_after(region[-1]):
        call = graph.call_function(
            quantree_ops.program.default,
            (
                inputs, const_nodes, attrs["code"], attrs["fcode"], attrs["slots"], attrs["in"],
                attrs["out"], in_shapes, [len(shapes[x][0]) for x in inputs], out_shapes,
                [len(shapes[x][0]) for x in outputs],
                [0 if shapes[x][1] == torch.float32 else 1 for x in outputs], *sizes,
            ),
        )  # fmt: skip
    call.meta[FLOAT_OPS_KEY] = float_ops
    call.meta["nn_module_stack"] = region[-1].meta.get("nn_module_stack", {})
    last = call
    for i, n in enumerate(outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, i))
        last.meta["val"] = n.meta.get("val")
        shapes[last] = shapes[n]  # a later region may read it
        n.replace_all_uses_with(last)
    for n in reversed(region):
        if not n.users:
            graph.erase_node(n)
    return True


def _symbolic(
    p: RegionProgram, inputs: list[fx.Node], shapes: dict[fx.Node, Shape]
) -> tuple[list[list[int]], list[int]] | None:
    """The slot table with rows and offsets as ``a + b * symbol`` (fields 5-7: rows' a and
    b, the offset's b), and where the symbol is read: ``[input, dim, a, b]`` of an input
    dimension ``a + b * symbol`` (empty for a static program). None: not one symbol."""
    symbols: set[sympy.Symbol] = set()
    for rec in p.slots:
        for d in (rec[2], rec[5]):
            symbols |= sympy.sympify(d).free_symbols
    if len(symbols) > 1:
        return None
    slots = []
    for dtype, base, offset, cols, ld, rows in p.slots:
        off, n = _linear(offset), _linear(rows)
        if off is None or n is None:
            return None
        slots.append([dtype, base, off[0], cols, ld, n[0], n[1], off[1]])
    if not symbols:
        return slots, []
    for i, x in enumerate(inputs):
        for dim, d in enumerate(shapes[x][0]):
            a, b = _linear(d) or (0, 0)
            if b > 0 and a >= 0:  # the call checks a >= 0 (program_checks.symbol)
                return slots, [i, dim, a, b]
    return None
