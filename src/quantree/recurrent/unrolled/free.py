"""Let a folded loop's graph run at any length: the sizes export pinned, read from the input.

``torch.export`` traces a Python loop over ``range(T)`` at the example's ``T``, so it fixes
``T``, and the graph around the loop holds it as literal integers (a ``view``'s sizes, a
``slice``'s end). Once the loop is folded, only those integers still pin the length. Which
integers they are cannot be told from one graph (a hidden size may equal ``T``), so the model
is captured a second time with the time dimension one longer: the integers that changed are
``a T + c``, and become that expression of the input's size at run time. The freed graph
must then compute exactly what the second capture computes on its input, else it keeps the
captured length and says so once.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from quantree.core.capturing.shape_guards import note_fixed_by_code
from quantree.core.errors import QuantreeWarning
from quantree.recurrent.decompose import drop_export_guards
from quantree.recurrent.unrolled.fold import fold_loops, is_cell_step
from quantree.recurrent.unrolled.higher_order import fold_scans
from quantree.recurrent.unrolled.step_loop import StepLoop
from quantree.recurrent.unrolled.symbolic import eval_size, length_symbol, symbolic_val

Recapture = Callable[[tuple[Any, ...], Mapping[str, Any] | None], fx.GraphModule]
AUTO_MIN_STEPS = 8
"""The shortest run ``quantree.capture`` folds on its own. A few unrolled steps (a decoder
stepped a fixed handful of times) lower to one native call each and have no length to free;
a loop pays Python per step, so folding starts where the sequence is long."""
AUTO_MIN_WINDOWS = 4
"""The shortest chunkwise run (steps that read ``narrow`` windows of an input) it folds:
each step is a chunk of many time steps (xLSTM's mLSTM: 4 chunks of 16 at 64 tokens), so a
few steps are already a long sequence. A fold whose step stays in Python is discarded by
``quantize``'s trial either way."""
MAX_TRIES = 3
"""Input dimensions tried as the time dimension (those as long as a loop's steps)."""


def fold_and_free(
    gm: fx.GraphModule,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    recapture: Recapture,
    min_steps: int = AUTO_MIN_STEPS,
    every_loop: bool = True,
    min_windows: int = AUTO_MIN_WINDOWS,
    free_chunks: bool = True,
) -> fx.GraphModule:
    """Fold ``gm``'s unrolled loops of at least ``min_steps`` steps (in place) and free their
    length where it can be shown.

    ``free_chunks=False`` frees only loops of one element a step: a chunk loop (``chunk``
    elements a step) then keeps its captured length. Freed, its graph's sizes are multiples
    of a symbol, which the CPU backend's region programs hold in fewer places (a transposed
    or 5-d value whose symbolic size is not its first) than the captured sizes, so the
    freed model costs more at the captured length.

    ``every_loop=False`` (``quantree.capture``'s default) folds only loops whose step is a
    recurrent cell, which lower to one native program; a model with any other loop over time
    keeps its unrolled steps with one warning, since its folded step would run op by op in
    Python, slower than the unrolled graph's fused regions."""
    from quantree.core.graphs import copy_graph_module

    scans = fold_scans(gm)  # torch's scan: a loop already, of any length
    before: list[fx.GraphModule] = []  # the graph as it was, copied only if a loop is found
    keep = None if every_loop else lambda: before.append(copy_graph_module(gm))
    made = fold_loops(gm, min_steps, before_first_fold=keep, min_windows=min_windows)
    general = [n for n in made if not is_cell_step(gm.get_submodule(n))]
    if before and general:
        _note_fixed_lengths(before[0], leaves_of(example_args, example_kwargs), made, gm)
        warnings.warn(
            f"quantree.capture left {len(general)} Python loop(s) over time unrolled (fixed to "
            "the captured length): their steps are not recurrent cells, which a folded loop "
            "runs natively, and a folded step runs op by op in Python, slower than the unrolled "
            "steps. Pass fold_loops=True to fold them anyway (one loop that runs at any "
            "length), or capture at the length you run at.",
            QuantreeWarning,
            stacklevel=4,
        )
        return before[0]
    loops = [gm.get_submodule(name) for name in made]
    steps = {loop.steps_captured for loop in loops if isinstance(loop, StepLoop) and loop.free}
    if not steps or scans:
        return gm
    leaves, spec = tree_flatten((example_args, example_kwargs))
    for index, dim, chunk in _candidates(leaves, steps, free_chunks):
        longer = list(leaves)
        x = leaves[index]
        longer[index] = torch.cat([x, x.narrow(dim, 0, chunk)], dim)  # one step (chunk) more
        args2, kwargs2 = tree_unflatten(longer, spec)
        try:
            gm2 = recapture(args2, kwargs2)
        except Exception:  # a dimension the model does not let vary
            continue
        fold_loops(gm2, min_steps, min_windows=min_windows)
        freed = _generalise(gm, gm2, index, dim, x.shape[dim] // chunk, chunk)
        if freed is not None and _same(freed, gm2, args2, kwargs2):
            return freed
    _note_fixed_lengths(gm, leaves, made, gm, tried_steps=True, tried_chunks=free_chunks)
    warnings.warn(
        f"{', '.join(made)}: the loop(s) folded from the unrolled time steps run only at the "
        f"captured length ({', '.join(map(str, sorted(steps)))} steps): the graph around them "
        "could not be shown to work at another length. Capture at the length you run at"
        + ("." if free_chunks else " (a loop over chunks is freed with fold_loops=True)."),
        QuantreeWarning,
        stacklevel=4,
    )
    return gm


def leaves_of(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> list[Any]:
    return tree_flatten((args, kwargs))[0]


def _note_fixed_lengths(
    module: fx.GraphModule,
    leaves: list[Any],
    made: list[str],
    folded: fx.GraphModule,
    tried_steps: bool = False,
    tried_chunks: bool = False,
) -> None:
    """Tell ``module``'s shape guard which input dimensions look like a loop's length, so a
    call at another length says what frees it: ``dynamic_shapes`` cannot, export unrolls
    the model's loop at whatever length it traces. ``tried_steps`` / ``tried_chunks``: freeing
    loops of one element / of a chunk a step was tried and failed (only capturing at the
    length run at is left)."""
    steps = {m.steps_captured for n in made if isinstance(m := folded.get_submodule(n), StepLoop)}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for index, dim, chunk in _candidates(leaves, steps):
        if index >= len(placeholders):
            continue
        length = leaves[index].shape[dim]
        loop = (
            f"a Python loop over it in {length // chunk} chunks of {chunk}"
            if chunk > 1
            else f"a Python loop over its {length} steps"
        )
        runs = f"any multiple of {chunk}" if chunk > 1 else "any length"
        fix = (
            "capture (quantize) at the length you run at: the folded loop could not be shown "
            "to run at another length"
            if (tried_chunks if chunk > 1 else tried_steps)
            else f"pass fold_loops=True to qt.quantize (or qt.capture) to fold it into one loop "
            f"that runs at {runs} where the graph around it allows (it warns where not), or "
            "capture at the length you run at"
        )
        note = (
            f"The model's code runs {loop}, which torch.export unrolled at the captured "
            f"length (dynamic_shapes cannot free it: export unrolls the loop again); {fix}."
        )
        note_fixed_by_code(module, placeholders[index].name, dim, note)


def _candidates(
    leaves: list[Any], steps: set[int], chunks: bool = True
) -> list[tuple[int, int, int]]:
    """``(input, dimension, chunk)`` that may hold the loops' time: a dimension as long as a
    loop's steps (one element a step), then one a multiple of them (a chunkwise loop, a
    Python ``for`` over ``T // chunk`` windows: ``chunk`` elements a step)."""
    exact, chunked = [], []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        for d in range(leaf.dim()):
            size = leaf.shape[d]
            if size in steps:
                exact.append((i, d, 1))
            elif chunks:
                found = [size // n for n in sorted(steps) if n > 1 and size % n == 0]
                chunked += [(i, d, c) for c in found if c > 1]
    return (exact + chunked)[:MAX_TRIES]


def _generalise(
    gm: fx.GraphModule, gm2: fx.GraphModule, index: int, dim: int, length: int, chunk: int = 1
) -> fx.GraphModule | None:
    """A copy of ``gm`` whose integers that differ in ``gm2`` (captured one step longer)
    are computed from input ``index``'s dimension ``dim``; None where the graphs differ.
    ``length`` is the captured steps; a step is ``chunk`` elements of that dimension, so the
    freed graph checks at run time that the dimension is a multiple of ``chunk`` (the chunk
    loop export unrolled covered whole chunks; the model's own code may take another path
    for a remainder, which this graph does not hold)."""
    from quantree.core.graphs import copy_graph_module

    nodes, nodes2 = list(gm.graph.nodes), list(gm2.graph.nodes)
    if len(nodes) != len(nodes2):
        return None
    edits: dict[int, dict[int, tuple[int, int]]] = {}
    for i, (a, b) in enumerate(zip(nodes, nodes2, strict=True)):
        if a.op != b.op or (a.op == "call_function" and a.target != b.target):
            return None
        if a.op == "call_module":
            m1, m2 = gm.get_submodule(str(a.target)), gm2.get_submodule(str(b.target))
            if isinstance(m1, StepLoop) != isinstance(m2, StepLoop):
                return None
            if isinstance(m1, StepLoop) and not (m1.free and m2.free):
                return None
        la, sa = tree_flatten((a.args, a.kwargs))
        lb, sb = tree_flatten((b.args, b.kwargs))
        if sa != sb:
            return None
        for p, (x, y) in enumerate(zip(la, lb, strict=True)):
            if type(x) is int and type(y) is int and x != y:
                edits.setdefault(i, {})[p] = (y - x, x - (y - x) * length)
            elif isinstance(x, fx.Node) != isinstance(y, fx.Node):
                return None
    freed = copy_graph_module(gm)
    drop_export_guards(freed)
    graph = freed.graph
    new_nodes = list(graph.nodes)
    placeholders = [n for n in new_nodes if n.op == "placeholder"]
    if index >= len(placeholders):
        return None
    source = placeholders[index]
    with graph.inserting_before(placeholders[-1].next):  # in order, after the inputs
        size = graph.call_function(torch.ops.aten.sym_size.int, (source, dim))
        size.meta["val"] = length * chunk
        if chunk > 1:
            size = _chunk_count(graph, size, chunk, length, _input_name(source, index, dim))
    renumbered = [n for n in new_nodes if n.op != "call_module" or n.target != "_guards_fn"]
    kept = [n for n in nodes if n.op != "call_module" or n.target != "_guards_fn"]
    position = {n: k for k, n in enumerate(kept)}
    for i, leaf_edits in edits.items():
        node = renumbered[position[nodes[i]]]
        leaves, spec = tree_flatten((node.args, node.kwargs))
        with graph.inserting_before(node):
            for p, (slope, offset) in leaf_edits.items():
                value: Any = size
                if slope != 1:
                    value = graph.call_function(operator.mul, (value, slope))
                    value.meta["val"] = length * slope
                if offset:
                    value = graph.call_function(operator.add, (value, offset))
                    value.meta["val"] = length * slope + offset
                leaves[p] = value
        node.args, node.kwargs = tree_unflatten(leaves, spec)
    symbol = length_symbol(nodes, length)
    if symbol is not None:
        size.meta["val"] = symbol
        if chunk > 1:  # the dimension read (its remainder by the chunk is 0 for any symbol)
            raw = size.args[0]
            assert isinstance(raw, fx.Node)
            raw.meta["val"] = symbol * chunk
        for i, (a, b) in enumerate(zip(nodes, nodes2, strict=True)):
            if a in position:
                node = renumbered[position[a]]
                node.meta["val"] = symbolic_val(
                    a.meta.get("val"), b.meta.get("val"), symbol, length
                )
                if i in edits:  # the sizes computed from the symbol
                    for arg in tree_flatten((node.args, node.kwargs))[0]:
                        if isinstance(arg, fx.Node) and arg.target in (operator.mul, operator.add):
                            eval_size(arg, symbol, size)
    graph.lint()
    freed.recompile()
    return freed


def _input_name(source: fx.Node, index: int, dim: int) -> str:
    return f"input {index} ({source.name}) dimension {dim}"


def _chunk_count(graph: fx.Graph, size: fx.Node, chunk: int, length: int, where: str) -> fx.Node:
    """``size // chunk``, after an ``_assert_scalar`` that ``size % chunk == 0`` whose message
    names the guard, the captured length and the fix (ops a saved model may hold)."""
    rest = graph.call_function(operator.mod, (size, chunk))
    rest.meta["val"] = 0
    whole = graph.call_function(operator.eq, (rest, 0))
    whole.meta["val"] = True
    message = (
        f"quantree: a loop folded from {length} unrolled chunks of {chunk} was captured at "
        f"{length * chunk} along {where}; it runs at multiples of {chunk} only (guard: "
        f"length % {chunk} == 0), and the model's own code may compute a remainder another "
        "way. Run at a multiple of the chunk, or capture (quantize) at the length you run at."
    )
    check = graph.call_function(torch.ops.aten._assert_scalar.default, (whole, message))
    check.meta["val"] = None
    count = graph.call_function(operator.floordiv, (size, chunk))
    count.meta["val"] = length
    return count


def _same(freed: fx.GraphModule, gm2: fx.GraphModule, args: tuple[Any, ...], kwargs: Any) -> bool:
    try:
        with torch.no_grad():
            got = tree_flatten(freed(*args, **(kwargs or {})))[0]
            want = tree_flatten(gm2(*args, **(kwargs or {})))[0]
    except Exception:  # a freed graph that fails is not freed
        return False
    return len(got) == len(want) and all(
        torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w
        for g, w in zip(got, want, strict=True)
    )
