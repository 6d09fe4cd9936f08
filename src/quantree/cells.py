"""Cells mode: a recurrent node becomes a loop over a cell graph.

The loop is a module of our own rather than unrolled time steps or PyTorch's ``scan``:
``CellLoop`` runs its body ``GraphModule`` once per step, so the graph does not grow with the
sequence length, the length may change between calls, and observers inside the body
accumulate statistics over every step. ``scan`` was the alternative; its eager path runs the
same Python loop, and a plain module keeps the body an ordinary GraphModule that prepare,
convert and backends treat exactly like the main graph.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from quantree.cells_body import CellWeights, gru_body, lstm_body, rnn_body
from quantree.graphs import fetch_attr
from quantree.points import CellsOptions
from quantree.recurrent import RecurrentCall
from quantree.values import arg_at, tensor_meta


class CellLoop(nn.Module):
    """Runs ``body(x_t, *state) -> new state`` over time; the first state leaf is the output."""

    def __init__(self, body: fx.GraphModule, reverse: bool) -> None:
        super().__init__()
        self.body = body
        self.reverse = reverse

    def forward(self, xs: torch.Tensor, state: tuple[torch.Tensor, ...]):
        steps = range(xs.shape[0] - 1, -1, -1) if self.reverse else range(xs.shape[0])
        outputs: list[torch.Tensor] = [xs] * xs.shape[0]
        for t in steps:
            state = tuple(self.body(xs[t], *state))
            outputs[t] = state[0]
        return torch.stack(outputs), state


class RecurrentCells(nn.Module):
    """A whole ``aten.lstm/gru/rnn_*`` call as cell loops: same inputs, same outputs."""

    def __init__(
        self, call: RecurrentCall, loops: dict[str, CellLoop], state_sizes: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.state_sizes = state_sizes
        self.kind = call.kind
        self.num_layers = call.num_layers
        self.directions = 2 if call.bidirectional else 1
        self.batch_first = call.batch_first
        self.loops = nn.ModuleDict(loops)

    def forward(self, x: torch.Tensor, hx: Any):
        """``hx`` leaves that are None are zero states sized for this call's batch."""
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        if self.batch_first:
            x = x.transpose(0, 1)
        count = self.num_layers * self.directions
        states = [
            x.new_zeros(count, x.shape[1], size) if s is None else s
            for s, size in zip(states, self.state_sizes, strict=True)
        ]
        finals: list[list[torch.Tensor]] = [[] for _ in states]
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.directions):
                index = layer * self.directions + d
                loop = self.loops[loop_name(layer, d)]
                out, final = loop(x, tuple(s[index] for s in states))
                outs.append(out)
                for k, s in enumerate(final):
                    finals[k].append(s)
            x = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        if self.batch_first:
            x = x.transpose(0, 1)
        return (x, *(torch.stack(f) for f in finals))


def loop_name(layer: int, direction: int) -> str:
    return f"l{layer}{'_reverse' if direction else ''}"


def build_cells(gm: fx.GraphModule, node: fx.Node, options: CellsOptions) -> RecurrentCells:
    """The cell loops that compute ``node`` (an aten recurrent call of ``gm``)."""
    call = RecurrentCall.parse(node)
    x_meta = tensor_meta(node.args[0])  # type: ignore[arg-type]
    states = [tensor_meta(arg_at(node, p)) for p in call.state_paths]
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
        example_states = [torch.zeros(batch, s.shape[-1]) for s in states]
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
    return RecurrentCells(call, loops, tuple(s.shape[-1] for s in states))


def decompose(gm: fx.GraphModule, node: fx.Node, options: CellsOptions) -> fx.Node:
    """Replace ``node`` by a call of its cell loops; every user keeps reading the same leaves."""
    cells = build_cells(gm, node, options)
    name = f"{node.name}_cells"
    gm.add_submodule(name, cells)
    states: Any = node.args[1]  # export's default zeros pin the captured batch: drop them
    if isinstance(states, list | tuple):
        states = [None if _is_zeros(s) else s for s in states]
    elif _is_zeros(states):
        states = None
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_module(name, (node.args[0], states))
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


def cell_bodies(gm: nn.Module) -> list[fx.GraphModule]:
    """Every cell body under ``gm``, in a stable order."""
    return [m.body for m in gm.modules() if isinstance(m, CellLoop)]
