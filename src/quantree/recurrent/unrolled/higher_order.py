"""torch's loop operators in a captured graph: ``scan`` becomes a ``StepLoop``, ``while_loop``
is refused with the fix.

``torch.ops.higher_order.scan(combine, inits, xs, additional)`` is what ``StepLoop`` already
is: the combine graph takes ``(*carry, *x_t, *additional)`` and returns
``(*next_carry, *y_t)``, ``xs`` are cut along dimension 0 and the ``y_t`` stacked along it.
So the scan's graph becomes the loop's body (the weights it reads become its own constants,
so a quantizer sees them as weights), and the step is annotated once like any other loop.
``while_loop`` runs until a condition computed from data holds: no fixed time dimension to
iterate over, so quantree names it and says what to write instead.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.graphs import copy_graph_module, fetch_attr, unique_attr
from quantree.core.points import POINT_KEY
from quantree.recurrent.unrolled.step_loop import StepInput, StepLoop, StepOutput

WHILE_FIX = (
    "write the loop as a Python `for` loop over the time dimension (for t in "
    "range(x.shape[1]): ...) and capture with quantree.capture(..., fold_loops=True): it "
    "folds the steps torch.export unrolls back into one loop, quantized once and run at any "
    "length"
)


def loop_op(node: fx.Node) -> str | None:
    """``scan``/``while_loop``/... when ``node`` calls one of torch's loop operators."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    name = node.target.name()
    return name if name in ("scan", "while_loop", "associative_scan", "map_impl") else None


def fold_scans(gm: fx.GraphModule) -> list[str]:
    """Replace every ``scan`` of ``gm`` by a ``StepLoop``; refuse the other loop operators."""
    made = []
    for node in list(gm.graph.nodes):
        name = loop_op(node)
        if name is None:
            continue
        if name != "scan" or len(node.args) != 4 or node.kwargs:
            raise QuantreeError(
                f"node {node.name} calls torch.ops.higher_order.{name}, which quantree does "
                f"not quantize; {WHILE_FIX}"
            )
        made.append(_fold_scan(gm, node))
    if made:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return made


def _fold_scan(gm: fx.GraphModule, node: fx.Node) -> str:
    combine, inits, xs, additional = node.args
    assert isinstance(combine, fx.Node) and isinstance(inits, list | tuple)
    assert isinstance(xs, list | tuple) and isinstance(additional, list | tuple)
    body = copy_graph_module(gm.get_submodule(str(combine.target)))  # type: ignore[arg-type]
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    first_extra = len(inits) + len(xs)
    outer_args: list[fx.Node] = [*inits, *xs]  # type: ignore[list-item]
    for ph, outer in zip(placeholders[first_extra:], additional, strict=True):
        if isinstance(outer, fx.Node) and outer.op == "get_attr":  # a weight: the body's own
            attr = unique_attr(body, str(outer.target).replace(".", "_"))
            body.register_buffer(attr, fetch_attr(gm, str(outer.target)))
            with body.graph.inserting_before(ph):
                const = body.graph.get_attr(attr)
            const.meta = copy.copy(ph.meta)
            ph.replace_all_uses_with(const)
            body.graph.erase_node(ph)
        else:
            outer_args.append(outer)  # type: ignore[arg-type]
    for i, ph in enumerate(placeholders[: len(inits)]):
        ph.meta[POINT_KEY] = f"state{i}"
    body.graph.lint()
    body.recompile()
    outputs = next(n for n in body.graph.nodes if n.op == "output").args[0]
    n_ys = len(outputs) - len(inits)  # type: ignore[arg-type]
    length = xs[0].meta["val"].shape[0] if xs else 0  # type: ignore[union-attr]
    hint = length if isinstance(length, int) else length.node.hint
    loop = StepLoop(
        body,
        len(inits),
        tuple(StepInput(0, 0, 1, 0) for _ in xs),
        tuple(StepOutput("stack", 0, False) for _ in range(n_ys)),
        int(hint or 1),
        free=bool(xs),
    )
    name = unique_attr(gm, "step_loop")
    gm.add_submodule(name, loop)
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(name, tuple(outer_args))
    call.meta = copy.copy(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    if not combine.users:
        gm.graph.erase_node(combine)
        delattr(gm, str(combine.target))
    return name
