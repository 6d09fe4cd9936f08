"""A folded step's bool per-step inputs read as float 0/1, so that the step is one program.

Region programs hold float32 and int8 values only. A mask a model multiplies by (a scan's
``gate * ~reset``: RecurrentGemma's RG-LRU) becomes a bool per-step input of the folded
step once the elementwise producers before the loop move into it
(``recurrent/unrolled/sink.py``), and the step then ran op by op in Python. Where every
reader of such an input is a ``mul`` by a float32 tensor, or a ``bitwise_not`` /
``logical_not`` whose readers are, the mask is cast to float32 once before the loop (one
op over the whole ``[B, T, ...]`` tensor), the negations become ``1 - m`` and the products
stay products: ``x * True`` and ``x * False`` promote the bool to 1.0 and 0.0, so every value
is the same bit for bit. Anything else reading the mask leaves the loop as it was.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from quantree.core.graphs import copy_graph_module
from quantree.recurrent.unrolled.step_loop import StepLoop

aten = torch.ops.aten
NOTS = {aten.bitwise_not.default, aten.logical_not.default}


def float_masks(loop: StepLoop) -> tuple[StepLoop, list[int]] | None:
    """A copy of ``loop`` whose bool mask inputs are float32, and their per-step input
    indices (its call must then pass them cast: ``cast_sources``); None where it has none."""
    body = copy_graph_module(loop.body)
    placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
    n, m = loop.n_states, len(loop.inputs)
    masks = [i for i in range(m) if _is_mask(placeholders[n + i])]
    if not masks:
        return None
    for i in masks:
        _to_float(body, placeholders[n + i])
    body.graph.lint()
    body.recompile()
    return StepLoop(body, n, loop.inputs, loop.outputs, loop.steps_captured, loop.free), masks


def call_of(gm: fx.GraphModule, name: str) -> fx.Node | None:
    """The one call of submodule ``name`` in ``gm``'s own graph (None: none, or several)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == name]
    return calls[0] if len(calls) == 1 else None


def cast_sources(gm: fx.GraphModule, call: fx.Node, n_states: int, masks: list[int]) -> None:
    """Make ``call`` read its per-step inputs ``masks`` cast to float32 before it."""
    args = list(call.args)
    for i in masks:
        source = args[n_states + i]
        with gm.graph.inserting_before(call):
            cast = gm.graph.call_function(
                aten._to_copy.default, (source,), {"dtype": torch.float32}
            )
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if isinstance(val, Tensor):
            cast.meta["val"] = val.to(torch.float32)
        args[n_states + i] = cast
    call.args = tuple(args)
    gm.graph.lint()
    gm.recompile()


def _bool(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, Tensor) and val.dtype == torch.bool


def _float(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, Tensor) and val.dtype == torch.float32


def _is_mask(p: fx.Node) -> bool:
    """Whether bool placeholder ``p`` is read only by products with float32 tensors, itself
    or negated (the products' shapes those of the float operand: no broadcast by the mask)."""
    if not _bool(p) or not p.users:
        return False
    for user in p.users:
        if user.target in NOTS and len(user.args) == 1 and not user.kwargs and user.users:
            if not all(_product(u, user) for u in user.users):
                return False
        elif not _product(user, p):
            return False
    return True


def _product(user: fx.Node, mask: fx.Node) -> bool:
    """``user`` is ``mul(x, mask)`` or ``mul(mask, x)`` of a float32 ``x`` of its own shape."""
    if user.target != aten.mul.Tensor or user.kwargs or len(user.args) != 2:
        return False
    other: list[Any] = [a for a in user.args if a is not mask]
    if len(other) != 1 or not _float(other[0]) or not _float(user):
        return False
    return list(other[0].meta["val"].shape) == list(user.meta["val"].shape)


def _to_float(body: fx.GraphModule, p: fx.Node) -> None:
    """Make ``p`` float32 and its negations ``1 - p``."""
    p.meta["val"] = p.meta["val"].to(torch.float32)
    for user in list(p.users):
        if user.target not in NOTS:
            continue
        with body.graph.inserting_before(user):
            flipped = body.graph.call_function(aten.rsub.Scalar, (p, 1))
        flipped.meta = dict(user.meta)
        flipped.meta["val"] = p.meta["val"].clone()
        user.replace_all_uses_with(flipped)
        body.graph.erase_node(user)
