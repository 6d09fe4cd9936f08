"""A folded loop's ``aten.*_cell`` ops, written out as cells mode's cell graph.

A hand-written ``GRUCell``/``LSTMCell``/``RNNCell`` loop folds into a loop whose step holds
one ATen cell op. Written out as cells mode's cell graph (``recurrent.cell_graph``: the same
linears, chunk, sigmoid/tanh and products), the step's gates and states become named points
like a cells-mode layer's, and the CPU backend runs the step as its native cell program.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import fetch_attr, unique_attr
from quantree.recurrent.call import CELL_OPS
from quantree.recurrent.cell_graph import CellWeights, gru_body, lstm_body, rnn_body

aten = torch.ops.aten


def write_out_cells(body: fx.GraphModule) -> int:
    """Replace each cell op of ``body`` (weights read with ``get_attr``) by its cell graph;
    how many were replaced."""
    done = 0
    for node in list(body.graph.nodes):
        if node.op == "call_function" and node.target in CELL_OPS and _write_out(body, node):
            done += 1
    if done:
        for n in list(body.graph.nodes):  # the cell ops' fused weights, now read by nobody
            if n.op == "get_attr" and not n.users:
                body.graph.erase_node(n)
                delattr(body, str(n.target))
        body.graph.lint()
        body.recompile()
    return done


def _size(n: Any) -> int:
    return int(n) if isinstance(n, int) else int(n.node.hint or 2)


def _write_out(body: fx.GraphModule, node: fx.Node) -> bool:
    x, hx, *params = node.args
    if len(params) != 4 or not all(p is None or getattr(p, "op", "") == "get_attr" for p in params):
        return False
    w_ih, w_hh, b_ih, b_hh = (
        None if p is None else fetch_attr(body, str(p.target))  # type: ignore[union-attr]
        for p in params
    )
    if w_ih is None or w_hh is None or not isinstance(x, fx.Node):
        return False
    states = list(hx) if isinstance(hx, list | tuple) else [hx]
    if not all(isinstance(s, fx.Node) for s in states):
        return False
    xv = x.meta["val"]
    if xv.dim() != 2:
        return False
    lstm = node.target == aten.lstm_cell.default
    if lstm and not all(u.target is operator.getitem for u in node.users):
        return False  # left as written: the graph reads the pair itself
    batch = _size(xv.shape[0])
    example_x = torch.zeros(batch, _size(xv.shape[1]))
    example_s = [torch.zeros(batch, _size(s.meta["val"].shape[1])) for s in states]  # type: ignore[union-attr]
    weights = CellWeights(w_ih, w_hh, b_ih, b_hh)
    scope = dict(node.meta.get("nn_module_stack") or {})
    if lstm and len(example_s) == 2:
        cell = lstm_body(weights, example_x, example_s[0], example_s[1], False, scope)
    elif lstm:
        return False
    elif node.target == aten.gru_cell.default:
        cell = gru_body(weights, example_x, example_s[0], False, scope)
    else:
        cell = rnn_body(
            weights, example_x, example_s[0], node.target == aten.rnn_relu_cell.default, scope
        )
    env: dict[fx.Node, fx.Node] = {}
    inputs = iter([x, *states])
    with body.graph.inserting_before(node):
        for n in cell.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(inputs)  # type: ignore[assignment]
            elif n.op == "get_attr":
                attr = unique_attr(body, f"cell_{n.target}")
                body.register_buffer(attr, fetch_attr(cell, str(n.target)))
                new = body.graph.get_attr(attr)
                new.meta = dict(n.meta)
                env[n] = new
            elif n.op == "call_function":
                new = body.graph.node_copy(n, lambda a: env[a])
                new.meta = dict(n.meta)
                env[n] = new
            elif n.op == "output":
                outs = [env[o] for o in n.args[0]]  # type: ignore[union-attr]
    if lstm:
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])  # type: ignore[index]
            body.graph.erase_node(user)
    else:
        node.replace_all_uses_with(outs[0])
    body.graph.erase_node(node)
    return True
