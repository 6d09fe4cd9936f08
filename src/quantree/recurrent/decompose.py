"""Cells mode's decomposition hook: an ``aten`` recurrent call becomes a call of cell loops.

``CellsOptions`` is the hook itself: a recipe's rule returns
``Annotation(decompose=CellsOptions(...))`` and prepare calls it on its copy of the graph.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import fetch_attr
from quantree.core.values import arg_at, tensor_meta
from quantree.recurrent.call import RecurrentCall
from quantree.recurrent.cell_graph import CellWeights, gru_body, lstm_body, rnn_body
from quantree.recurrent.loop import CellLoop, RecurrentCells, loop_name


@dataclass(frozen=True)
class CellsOptions:
    """How to decompose a recurrent layer: ``split_gates`` gives each gate its own linears.

    Called as a decomposition hook, it replaces the node by its cell loops.
    """

    split_gates: bool = False

    def __call__(self, gm: fx.GraphModule, node: fx.Node) -> None:
        decompose(gm, node, self)
        drop_export_guards(gm)


def drop_export_guards(gm: fx.GraphModule) -> None:
    """Cell loops run any sequence length; export's guard pinned the captured one.

    (torch.export specializes the length of ``aten.lstm``'s input, so it cannot be marked
    dynamic at capture.) Ops elsewhere in the graph still check their own shapes.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)


def build_cells(gm: fx.GraphModule, node: fx.Node, options: CellsOptions) -> RecurrentCells:
    """The cell loops that compute ``node`` (an aten recurrent call of ``gm``)."""
    call = RecurrentCall.parse(node)
    x_meta = tensor_meta(node.args[0])  # type: ignore[arg-type]
    states = [tensor_meta(arg_at(node, p)) for p in call.state_paths]
    if call.packed:  # the packed rows say nothing of the batch; the states do
        batch = _example_size(states[0].shape[1])
    else:
        batch = _example_size(x_meta.shape[0] if call.batch_first else x_meta.shape[1])

    def param(path: Any) -> torch.Tensor:
        return fetch_attr(gm, str(arg_at(node, path).target))

    def optional(path: Any) -> torch.Tensor | None:
        return None if path is None else param(path)

    loops = {}
    for p in call.layers:
        w = CellWeights(
            param(p.w_ih), param(p.w_hh), optional(p.b_ih), optional(p.b_hh), optional(p.w_hr)
        )
        x = torch.zeros(batch, w.w_ih.shape[1])
        example_states = [torch.zeros(batch, _example_size(s.shape[-1])) for s in states]
        name = loop_name(p.layer, p.direction)
        stack = dict(node.meta.get("nn_module_stack") or {})
        owner = list(stack.values())[-1][0] if stack else ""
        stack[f"quantree_cells_{node.name}_{name}"] = (f"{owner}.{name}".lstrip("."), "CellLoop")
        if call.kind == "lstm":
            h, c = example_states
            body = lstm_body(w, x, h, c, options.split_gates, stack)
        elif call.kind == "gru":
            body = gru_body(w, x, example_states[0], options.split_gates, stack)
        else:
            body = rnn_body(w, x, example_states[0], call.kind == "rnn_relu", stack)
        loops[name] = CellLoop(body, reverse=p.direction == 1)
    return RecurrentCells(call, loops, tuple(_example_size(s.shape[-1]) for s in states))


def decompose(gm: fx.GraphModule, node: fx.Node, options: CellsOptions) -> fx.Node:
    """Replace ``node`` by a call of its cell loops; every user keeps reading the same leaves."""
    cells = build_cells(gm, node, options)
    name = f"{node.name}_cells"
    gm.add_submodule(name, cells)
    call = RecurrentCall.parse(node)
    states: Any = arg_at(node, call.state_paths[0][:1])  # export's default zeros pin the batch
    if isinstance(states, list | tuple):
        states = [None if _is_zeros(s) else s for s in states]
    elif _is_zeros(states):
        states = None
    with gm.graph.inserting_before(node):
        args: tuple[Any, ...] = (node.args[0], states)
        if call.batch_sizes_path is not None:
            args += (arg_at(node, call.batch_sizes_path),)
        replacement = gm.graph.call_module(name, args)
    replacement.meta = copy.copy(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    return replacement


def _example_size(size: int | torch.SymInt) -> int:
    """A concrete size to build the cell graph with (a dynamic batch has a hint, or is 2)."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else 2


def _is_zeros(node: object) -> bool:
    """A state made by ``zeros`` (nn.LSTM's default): the loop makes it per call instead."""
    return isinstance(node, fx.Node) and node.target in (
        torch.ops.aten.zeros.default,
        torch.ops.aten.new_zeros.default,
    )
