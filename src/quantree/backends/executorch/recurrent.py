"""Whole-mode LSTM layers written as the int8 patterns XNNPACK runs, for ExecuTorch.

XNNPACK has no LSTM, int8 or float: ExecuTorch unrolls ``aten.lstm`` into its own ops per
step. What it does run in int8 with a float output is a *dynamically quantized* linear
(``choose_qparams`` -> ``quantize``/``dequantize`` of the activation -> ``linear`` on a
per-channel int8 weight), the only int8 GEMM of XNNPACK whose output is not requantized
to int8. A quantized layer ``aten.lstm(dq(x), [dq(h0), dq(c0)], [dq(W_ih), dq(W_hh),
dq(b_ih), dq(b_hh)])`` of the reference graph is replaced by:

- the input projection of all time steps as **one** dynamically quantized linear
  ``x[T*B, I] @ W_ih^T + (b_ih + b_hh)`` on the reference's int8 ``W_ih`` (the input is already
  on an int8 grid, so its dynamic requantization loses next to nothing);
- per step, only the recurrent product ``h @ W_hh^T`` as a dynamically quantized linear on
  the reference's int8 ``W_hh``, then the gates in fp32 (sigmoid, tanh, products), which
  XNNPACK also takes.

Why this and not a custom-op library with quantree's kernels: a kernel library has to be
built against the exact ExecuTorch runtime that loads it and registered in it (its C++
``register_kernels``), which the ``executorch`` wheel's Python runtime does not let a
package add to; this rewrite needs nothing but what every ExecuTorch build with XNNPACK
has. The price: the loop is unrolled (the program grows with the sequence length, which is
fixed by the example), and ``h`` is requantized per step on a dynamic grid (per tensor,
from its own range) rather than kept float as in the reference.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import fetch_attr, register_constant
from quantree.core.qdq import is_dequantize

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
LSTM_OPS = (aten.lstm.input,)
EPS = torch.finfo(torch.float32).eps


def is_int8_lstm(node: fx.Node) -> bool:
    """A single-layer, one-direction LSTM whose weights are int8 dequantize nodes and whose
    biases are constants (``get_attr``)."""
    if node.op != "call_function" or node.target not in LSTM_OPS:
        return False
    args: Any = node.args
    _, _, params, has_biases, layers, _, _, bidirectional = args[:8]
    if not has_biases or layers != 1 or bidirectional or len(params) != 4:
        return False
    w_ih, w_hh, b_ih, b_hh = params
    constants = all(isinstance(b, fx.Node) and b.op == "get_attr" for b in (b_ih, b_hh))
    return constants and all(is_dequantize(w) and w.args[-1] == torch.int8 for w in (w_ih, w_hh))


class Emitter:
    """Appends ATen calls before one node of a graph."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node) -> None:
        self.graph, self.anchor = graph, anchor

    def __call__(self, op: Callable[..., Any], *args: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            return self.graph.call_function(op, args)

    def dynamic_linear(self, x: fx.Node, weight: fx.Node, bias: fx.Node | None) -> fx.Node:
        """``linear`` on ``x`` quantized to int8 on its own range: XNNPACK's qd8 GEMM."""
        params = self(qd.choose_qparams.tensor, x, -128, 127, EPS, torch.int8)
        scale, zero = self(operator.getitem, params, 0), self(operator.getitem, params, 1)
        q = self(qd.quantize_per_tensor.tensor, x, scale, zero, -128, 127, torch.int8)
        dq = self(qd.dequantize_per_tensor.tensor, q, scale, zero, -128, 127, torch.int8)
        return self(aten.linear.default, dq, weight, *([bias] if bias is not None else []))


def _shape(node: object) -> tuple[int, ...]:
    val = node.meta["val"] if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise TypeError(f"{node} has no tensor example")
    return tuple(int(s) for s in val.shape)


def decompose_lstm(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``node`` (see :func:`is_int8_lstm`) by the unrolled qd8 form. Its biases must
    be float constants already (``dialect.fold_wide_dequantize``): they are added once, as
    ``b_ih + b_hh``, to the input projection."""
    args: Any = node.args
    x, (h0, c0), (w_ih, w_hh, b_ih, b_hh) = args[0], args[1], args[2]
    float_bias = fetch_attr(gm, str(b_ih.target)) + fetch_attr(gm, str(b_hh.target))
    batch_first = bool(node.args[8])
    steps, batch, features = _shape(x)
    if batch_first:
        steps, batch = batch, steps
    hidden = _shape(h0)[-1]
    emit = Emitter(gm.graph, node)
    bias_name = register_constant(gm, "_et_lstm_bias_", float_bias)
    with gm.graph.inserting_before(node):
        bias = gm.graph.get_attr(bias_name)
    seq = emit(aten.transpose.int, x, 0, 1) if batch_first else x
    flat = emit(aten.reshape.default, seq, [steps * batch, features])
    projected = emit.dynamic_linear(flat, w_ih, bias)  # [steps * batch, 4 * hidden]
    h = emit(aten.reshape.default, h0, [batch, hidden])
    c = emit(aten.reshape.default, c0, [batch, hidden])
    outputs = []
    for t in range(steps):
        step = emit(aten.slice.Tensor, projected, 0, t * batch, (t + 1) * batch)
        gates = emit(aten.add.Tensor, step, emit.dynamic_linear(h, w_hh, None))

        def part(k: int, fn: Any, gates: fx.Node = gates) -> fx.Node:
            return emit(fn, emit(aten.slice.Tensor, gates, 1, k * hidden, (k + 1) * hidden))

        i, f = part(0, aten.sigmoid.default), part(1, aten.sigmoid.default)
        g, o = part(2, aten.tanh.default), part(3, aten.sigmoid.default)
        c = emit(aten.add.Tensor, emit(aten.mul.Tensor, f, c), emit(aten.mul.Tensor, i, g))
        h = emit(aten.mul.Tensor, o, emit(aten.tanh.default, c))
        outputs.append(h)
    out = emit(aten.stack.default, outputs, 1 if batch_first else 0)
    results = {
        0: out,
        1: emit(aten.unsqueeze.default, h, 0),
        2: emit(aten.unsqueeze.default, c, 0),
    }
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise TypeError(f"{user} reads {node} whole")
        user.replace_all_uses_with(results[int(user.args[1])])  # type: ignore[arg-type]
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
