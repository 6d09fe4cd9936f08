"""The cell graph of one recurrent layer and direction: one time step as an ATen graph.

Every internal tensor is a node with a stable name (its quantization point), so a quantizer
reaches the gates, the cell state and the hidden state like any other Value. Points:

- all kinds: ``x`` (step input), ``h_prev``, ``input_proj``, ``hidden_proj``, ``hidden``
- LSTM: ``c_prev``, ``gates`` (fused pre-activations), ``i_pre f_pre g_pre o_pre``,
  ``i f g o`` (sigmoid/tanh outputs), ``forget_cell`` (f*c), ``input_cell`` (i*g), ``cell``,
  ``cell_tanh``; with ``proj_size``: ``hidden_unprojected``. With ``split_gates`` each gate
  has its own ``input_proj_<gate>`` / ``hidden_proj_<gate>`` and ``<gate>_pre`` is their sum.
- GRU: ``reset_pre update_pre reset update``, ``candidate_hidden`` (r * hidden part),
  ``candidate_pre``, ``candidate``, ``hidden_delta`` (h - n), ``update_hidden`` (z * delta).
- RNN: ``pre`` (the pre-activation).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from quantree.core.points import POINT_KEY

aten = torch.ops.aten


@dataclass(frozen=True)
class CellWeights:
    """One layer and direction's parameters (None when absent)."""

    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None
    w_hr: torch.Tensor | None = None


class _Builder:
    """Builds a graph and evaluates it on example tensors as it goes (for ``meta['val']``)."""

    def __init__(self, scope: dict[str, Any]) -> None:
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.values: dict[fx.Node, Any] = {}
        self.scope = scope

    def _finish(self, node: fx.Node, value: Any, point: str) -> fx.Node:
        node.meta["val"] = value
        node.meta[POINT_KEY] = point
        node.meta["nn_module_stack"] = self.scope
        self.values[node] = value
        return node

    def input(self, name: str, example: torch.Tensor) -> fx.Node:
        return self._finish(self.graph.placeholder(name), example, name)

    def constant(self, name: str, tensor: torch.Tensor) -> fx.Node:
        tensor = tensor.detach()  # shares storage with the model's parameter, never written
        self.root.register_buffer(name, tensor)
        return self._finish(self.graph.get_attr(name), tensor, name)

    def op(self, point: str, target: Callable[..., Any], *args: Any) -> fx.Node:
        real = [self.values[a] if isinstance(a, fx.Node) else a for a in args]
        with torch.no_grad():
            value = target(*real)
        node = self.graph.create_node("call_function", target, tuple(args), name=point)
        return self._finish(node, value, point)

    def leaf(self, point: str, parent: fx.Node, index: int) -> fx.Node:
        node = self.graph.create_node(
            "call_function", operator.getitem, (parent, index), name=point
        )
        return self._finish(node, self.values[parent][index], point)

    def linear(self, point: str, x: fx.Node, w: fx.Node, b: fx.Node | None) -> fx.Node:
        return self.op(point, aten.linear.default, x, w, b)

    def module(self, outputs: tuple[fx.Node, ...]) -> fx.GraphModule:
        self.graph.output(outputs)
        gm = fx.GraphModule(self.root, self.graph, class_name="CellBody")
        gm.graph.lint()
        return gm


def _rows(t: torch.Tensor | None, k: int, parts: int) -> torch.Tensor | None:
    """Gate ``k`` of ``parts`` stacked gates (rows of a fused weight or bias), copied."""
    if t is None:
        return None
    size = t.shape[0] // parts
    return t[k * size : (k + 1) * size].clone()


def _proj(
    b: _Builder, name: str, x: fx.Node, w: torch.Tensor | None, bias: torch.Tensor | None
) -> fx.Node:
    assert w is not None
    w_node = b.constant(f"w_{name}", w)
    b_node = None if bias is None else b.constant(f"b_{name}", bias)
    return b.linear(name, x, w_node, b_node)


def _gate_projections(
    b: _Builder, x: fx.Node, h: fx.Node, w: CellWeights, gates: tuple[str, ...], split: bool
) -> list[fx.Node]:
    """Pre-activations per gate: fused (one projection, chunked) or one linear pair a gate."""
    if not split:
        ip = _proj(b, "input_proj", x, w.w_ih, w.b_ih)
        hp = _proj(b, "hidden_proj", h, w.w_hh, w.b_hh)
        total = b.op("gates", aten.add.Tensor, ip, hp)
        parts = b.op("gates_split", aten.chunk.default, total, len(gates), -1)
        return [b.leaf(f"{g}_pre", parts, k) for k, g in enumerate(gates)]
    pres = []
    n = len(gates)
    for k, g in enumerate(gates):
        ip = _proj(b, f"input_proj_{g}", x, _rows(w.w_ih, k, n), _rows(w.b_ih, k, n))
        hp = _proj(b, f"hidden_proj_{g}", h, _rows(w.w_hh, k, n), _rows(w.b_hh, k, n))
        pres.append(b.op(f"{g}_pre", aten.add.Tensor, ip, hp))
    return pres


def lstm_body(
    w: CellWeights,
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    split_gates: bool,
    scope: dict[str, Any],
) -> fx.GraphModule:
    b = _Builder(scope)
    xn, hn, cn = b.input("x", x), b.input("h_prev", h), b.input("c_prev", c)
    i_pre, f_pre, g_pre, o_pre = _gate_projections(b, xn, hn, w, ("i", "f", "g", "o"), split_gates)
    i = b.op("i", aten.sigmoid.default, i_pre)
    f = b.op("f", aten.sigmoid.default, f_pre)
    g = b.op("g", aten.tanh.default, g_pre)
    o = b.op("o", aten.sigmoid.default, o_pre)
    forget = b.op("forget_cell", aten.mul.Tensor, f, cn)
    write = b.op("input_cell", aten.mul.Tensor, i, g)
    cell = b.op("cell", aten.add.Tensor, forget, write)
    squashed = b.op("cell_tanh", aten.tanh.default, cell)
    if w.w_hr is None:
        hidden = b.op("hidden", aten.mul.Tensor, o, squashed)
    else:
        raw = b.op("hidden_unprojected", aten.mul.Tensor, o, squashed)
        hidden = b.linear("hidden", raw, b.constant("w_hr", w.w_hr), None)
    return b.module((hidden, cell))


def gru_body(
    w: CellWeights, x: torch.Tensor, h: torch.Tensor, split_gates: bool, scope: dict[str, Any]
) -> fx.GraphModule:
    b = _Builder(scope)
    xn, hn = b.input("x", x), b.input("h_prev", h)
    if split_gates:
        parts = [
            (
                _proj(b, f"input_proj_{gate}", xn, _rows(w.w_ih, k, 3), _rows(w.b_ih, k, 3)),
                _proj(b, f"hidden_proj_{gate}", hn, _rows(w.w_hh, k, 3), _rows(w.b_hh, k, 3)),
            )
            for k, gate in enumerate("rzn")
        ]
        (ir, hr), (iz, hz), (in_, hn_) = parts
    else:
        ip = _proj(b, "input_proj", xn, w.w_ih, w.b_ih)
        hp = _proj(b, "hidden_proj", hn, w.w_hh, w.b_hh)
        isplit = b.op("input_split", aten.chunk.default, ip, 3, -1)
        hsplit = b.op("hidden_split", aten.chunk.default, hp, 3, -1)
        ir, iz, in_ = (b.leaf(f"input_{k}", isplit, j) for j, k in enumerate("rzn"))
        hr, hz, hn_ = (b.leaf(f"hidden_{k}", hsplit, j) for j, k in enumerate("rzn"))
    r = b.op("reset", aten.sigmoid.default, b.op("reset_pre", aten.add.Tensor, ir, hr))
    z = b.op("update", aten.sigmoid.default, b.op("update_pre", aten.add.Tensor, iz, hz))
    gated = b.op("candidate_hidden", aten.mul.Tensor, r, hn_)
    n = b.op("candidate", aten.tanh.default, b.op("candidate_pre", aten.add.Tensor, in_, gated))
    delta = b.op("hidden_delta", aten.sub.Tensor, hn, n)
    moved = b.op("update_hidden", aten.mul.Tensor, z, delta)
    hidden = b.op("hidden", aten.add.Tensor, n, moved)
    return b.module((hidden,))


def rnn_body(
    w: CellWeights, x: torch.Tensor, h: torch.Tensor, relu: bool, scope: dict[str, Any]
) -> fx.GraphModule:
    b = _Builder(scope)
    xn, hn = b.input("x", x), b.input("h_prev", h)
    ip = _proj(b, "input_proj", xn, w.w_ih, w.b_ih)
    hp = _proj(b, "hidden_proj", hn, w.w_hh, w.b_hh)
    pre = b.op("pre", aten.add.Tensor, ip, hp)
    hidden = b.op("hidden", aten.relu.default if relu else aten.tanh.default, pre)
    return b.module((hidden,))


@functools.cache
def point_names(split_gates: bool) -> frozenset[str]:
    """Every point name a cell body of any kind can have (read off tiny example bodies)."""
    size, gates = 2, {"lstm": 4, "gru": 3, "rnn": 1}
    x, h = torch.zeros(1, size), torch.zeros(1, size)

    def weights(kind: str, projected: bool = False) -> CellWeights:
        rows = gates[kind] * size
        w_hr = torch.zeros(size, size) if projected else None
        return CellWeights(
            torch.zeros(rows, size), torch.zeros(rows, size), torch.zeros(rows), torch.zeros(rows),
            w_hr,
        )  # fmt: skip

    bodies = (
        lstm_body(weights("lstm"), x, h, h, split_gates, {}),
        lstm_body(weights("lstm", projected=True), x, h, h, split_gates, {}),
        gru_body(weights("gru"), x, h, split_gates, {}),
        rnn_body(weights("rnn"), x, h, False, {}),
    )
    return frozenset(
        n.meta[POINT_KEY] for body in bodies for n in body.graph.nodes if POINT_KEY in n.meta
    )
