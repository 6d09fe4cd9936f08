"""Fold unrolled recurrences back into loops: ``fold_loops(gm)``.

Each run that ``find.find_recurrence`` finds becomes one ``StepLoop`` call: its body is the
first step's nodes (copied with their metadata), the run's other steps are erased, and what
read the run (the last step's values, the ``stack``/``cat`` of every step's, a buffer the
steps wrote slice by slice) reads the loop's outputs. The loop computes the same ops on the
same tensors in the same order, so the folded graph equals the unrolled one exactly. Repeated
until no run is left (one loop per layer of a stacked model).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from quantree.core.graphs import fetch_attr, unique_attr
from quantree.core.points import POINT_KEY
from quantree.recurrent.unrolled.cells import write_out_cells
from quantree.recurrent.unrolled.find import find_recurrence
from quantree.recurrent.unrolled.recurrence import Recurrence, SeqInput, StepWrite
from quantree.recurrent.unrolled.sink import sink_producers
from quantree.recurrent.unrolled.step_loop import StepInput, StepLoop, StepOutput
from quantree.recurrent.unrolled.writes import captured_steps, covers

CELL_STEP_KEY = "quantree_cell_step"
"""``StepBody.meta`` key: True where the step's work is recurrent cell ops (``GRUCell``,
``LSTMCell``, ``RNNCell``), written out as cells mode's cell graph: the steps a backend can run
as one native cell program (see ``quantree.recurrent.unrolled.free``'s default policy)."""


def is_cell_step(loop: torch.nn.Module) -> bool:
    return isinstance(loop, StepLoop) and bool(loop.body.meta.get(CELL_STEP_KEY, False))


def fold_loops(
    gm: fx.GraphModule, min_steps: int = 3, before_first_fold: Callable[[], None] | None = None,
    min_windows: int | None = None,
) -> list[str]:  # fmt: skip
    """Fold every unrolled recurrence of ``gm`` in place; the names of the loops made.
    ``before_first_fold`` is called once, before ``gm`` is first changed (to keep a copy);
    ``min_windows``: ``find_recurrence``'s minimum for a chunkwise run."""
    made: list[str] = []
    while (rec := find_recurrence(gm, min_steps, min_windows)) is not None:
        if not made and before_first_fold is not None:
            before_first_fold()
        made.append(fold(gm, rec))
        if not is_cell_step(gm.get_submodule(made[-1])):  # a cell program reads its input whole
            sink_producers(gm, made[-1])
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def fold(gm: fx.GraphModule, rec: Recurrence) -> str:
    """Replace ``rec``'s run in ``gm`` by a ``StepLoop`` call; the loop's module name."""
    body, sources, invariants, outputs = _body(gm, rec)
    buffers = {write.buffer for write in rec.writes.values()}
    run = {n for block in rec.blocks for n in block}
    inputs = tuple(_step_input(s) for s in sources)
    free = all(covers(s, rec.steps) for s in sources)
    counts = {captured_steps(s) for s in sources}
    loop = StepLoop(body, len(rec.states), inputs, tuple(o for o, _ in outputs), rec.steps,
                    free and len(counts) == 1)  # fmt: skip
    name = unique_attr(gm, "step_loop")
    gm.add_submodule(name, loop)
    last = rec.blocks[-1][-1]
    args = (*rec.states.values(), *(s.src for s in sources), *invariants)
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, args)
    call.meta["nn_module_stack"] = copy.copy(rec.blocks[0][0].meta.get("nn_module_stack", {}))
    leaves: list[fx.Node] = []
    with gm.graph.inserting_after(call):
        for i in range(len(rec.states) + len(outputs)):
            leaves.append(gm.graph.call_function(operator.getitem, (call, i)))
    values: list[Any] = []
    for j, leaf in zip(rec.states, leaves, strict=False):
        leaf.meta = _leaf_meta(rec.blocks[-1][j])
        values.append(leaf.meta["val"])
    closed = {w.buffer: w for w in rec.writes.values() if w.initial is not None}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    after = max(leaves, key=order.__getitem__)
    for (_, target), leaf in zip(outputs, leaves[len(rec.states) :], strict=True):
        leaf.meta = _leaf_meta(target)
        if target in closed:  # the steps' states; the buffer is the initial one, then these
            after = joined = _prepend(gm, closed[target], leaf, after)
            leaf.meta["val"] = _narrow_val(target.meta["val"], closed[target])
            keep = run | set(closed[target].closing)  # erased below
            target.replace_all_uses_with(joined, delete_user_cb=lambda u, keep=keep: u not in keep)
        elif target in buffers:  # read after the run only (find's proof): the joined writes
            target.replace_all_uses_with(leaf, delete_user_cb=lambda user: user not in run)
        values.append(leaf.meta["val"])
        if target in rec.collected:
            target.replace_all_uses_with(leaf)
    call.meta["val"] = tuple(values)
    for j in rec.states:
        rec.blocks[-1][j].replace_all_uses_with(leaves[list(rec.states).index(j)])
    for j, (spec, target) in zip(range(len(outputs)), outputs, strict=True):
        if spec.kind == "last":
            target.replace_all_uses_with(leaves[len(rec.states) + j])
    for collector in rec.collected:
        gm.graph.erase_node(collector)
    read = {a for block in rec.blocks for n in block for a in n.all_input_nodes}
    for k in range(rec.steps - 1, -1, -1):
        for j in range(len(rec.blocks[k]) - 1, -1, -1):
            if k == 0 and j in rec.hoisted:
                continue
            gm.graph.erase_node(rec.blocks[k][j])
    for node in read:  # the weights only the steps read now live in the body
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    for write in closed.values():  # the write after the run: its slot is the loop's last
        for node in reversed(write.closing):
            gm.graph.erase_node(node)
    for buffer in buffers:  # a fresh tensor the loop's output replaced
        if not buffer.users:
            gm.graph.erase_node(buffer)
    return name


def _prepend(gm: fx.GraphModule, write: StepWrite, leaf: fx.Node, after: fx.Node) -> fx.Node:
    """``cat([initial, leaf])`` along the written dimension (the initial state unsqueezed
    where the steps ``select`` their slot), inserted after ``after``."""
    assert write.initial is not None
    dim, first = write.where.dim, write.initial
    with gm.graph.inserting_after(after):
        if write.where.width == 0:
            first = gm.graph.call_function(torch.ops.aten.unsqueeze.default, (first, dim))
            first.meta = {"val": write.initial.meta["val"].unsqueeze(dim)}
    with gm.graph.inserting_after(first if first is not write.initial else after):
        joined = gm.graph.call_function(torch.ops.aten.cat.default, ([first, leaf], dim))
    joined.meta = _leaf_meta(write.buffer)
    return joined


def _narrow_val(val: Any, write: StepWrite) -> Any:
    """The buffer's metadata value without its first slot: what the loop collects."""
    width = max(write.where.width, 1)
    return val.narrow(write.where.dim, width, val.shape[write.where.dim] - width)


def _leaf_meta(node: fx.Node) -> dict[str, Any]:
    meta = {k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
    return meta


def _body(gm: fx.GraphModule, rec: Recurrence):
    """The step graph, its sources and invariants (outer nodes) and its outputs."""
    graph = fx.Graph()
    root = torch.nn.Module()
    first = rec.blocks[0]
    env: dict[int, fx.Node] = {}
    state_in: dict[int, fx.Node] = {}
    for i, (j, init) in enumerate(rec.states.items()):
        ph = graph.placeholder(f"state{i}")
        ph.meta = {"val": init.meta.get("val"), POINT_KEY: f"state{i}"}
        state_in[j] = ph
    sources: list[SeqInput] = []
    for j, seq in rec.seq_of.items():
        ph = graph.placeholder(f"x{len(sources)}")
        ph.meta = {**_leaf_meta(first[j]), POINT_KEY: f"x{len(sources)}"}
        env[j] = ph
        sources.append(seq)
    outer: dict[fx.Node, fx.Node] = {}  # invariant outer node -> its body node
    invariant_args: list[fx.Node] = []

    def invariant(node: fx.Node) -> fx.Node:
        if node not in outer:
            if node.op == "get_attr":
                attr = unique_attr(root, str(node.target).replace(".", "_"))
                root.register_buffer(attr, fetch_attr(gm, str(node.target)))
                new = graph.get_attr(attr)
            else:
                new = graph.placeholder(f"invariant{len(invariant_args)}")
                invariant_args.append(node)
            new.meta = _leaf_meta(node)
            outer[node] = new
        return outer[node]

    written = set(rec.writes)
    for write in rec.writes.values():
        written.update((write.target, *write.views))
    for j, node in enumerate(first):
        if j in env or j in written:  # a write is an output (below), its slice no input
            continue
        if j in rec.hoisted:  # computed before the loop, read as an invariant if at all
            continue
        leaves, spec = tree_flatten((node.args, node.kwargs))
        new_leaves = []
        for leaf, kind in zip(leaves, rec.kinds[j], strict=True):
            if kind[0] == "internal" and kind[1] in rec.hoisted:
                new_leaves.append(invariant(first[kind[1]]))
            elif kind[0] == "internal":
                new_leaves.append(env[kind[1]])
            elif kind[0] == "carried":
                new_leaves.append(state_in[kind[1]])
            elif kind[0] == "invariant":
                new_leaves.append(invariant(leaf))
            else:
                new_leaves.append(leaf)
        args, kwargs = tree_unflatten(new_leaves, spec)
        new = graph.create_node("call_function", node.target, args, kwargs, name=node.name)
        new.meta = copy.copy(node.meta)
        env[j] = new
    out_nodes = [env[j] for j in rec.states]
    outputs: list[tuple[StepOutput, fx.Node]] = []
    for collector, (j, reverse) in rec.collected.items():
        join = "stack" if collector.target == torch.ops.aten.stack.default else "cat"
        dim = collector.args[1] if len(collector.args) > 1 else 0
        assert isinstance(dim, int)
        outputs.append((StepOutput(join, dim, reverse), collector))
        out_nodes.append(env[j])
    for write in rec.writes.values():
        w = write.where
        join = "stack" if w.width == 0 else "cat"
        outputs.append((StepOutput(join, w.dim, w.stride < 0), write.buffer))
        out_nodes.append(env[write.value])
    for j in rec.last:
        if j not in rec.states:
            outputs.append((StepOutput("last", 0, False), rec.blocks[-1][j]))
            out_nodes.append(env[j])
    graph.output(tuple(out_nodes))
    body = fx.GraphModule(root, graph, class_name="StepBody")
    graph.lint()
    body.meta[CELL_STEP_KEY] = write_out_cells(body) > 0
    return body, sources, invariant_args, outputs


def _step_input(seq: SeqInput) -> StepInput:
    if seq.stride > 0:
        return StepInput(seq.dim, seq.start, seq.stride, seq.width)
    size = seq.src.meta["val"].shape[seq.dim]
    return StepInput(seq.dim, int(size) - max(seq.width, 1) - seq.start, seq.stride, seq.width)
