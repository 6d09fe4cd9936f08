"""A stacked ReLU RNN split into one call per layer, so each layer's output is observed.

Whole mode observes a recurrent call's boundary only. The hidden states of the layers below
the last are never observed, and a backend must then bound them for any input: tanh, LSTM
and GRU states are bounded, a ReLU RNN's are not, so the CPU backend left a stacked
``nn.RNN(nonlinearity="relu")`` as the reference computes it (a float RNN that dequantized
its int8 weights on every call, slower than float). One ``aten.rnn_relu`` per layer computes
the same thing (PyTorch runs the layers one after another too) and makes each layer's
output an ordinary Value: observed, quantized, and each call one native layer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from quantree.recurrent.call import RecurrentCall

aten = torch.ops.aten


def splittable(node: fx.Node) -> bool:
    """A padded (not packed) ``aten.rnn_relu`` call of more than one layer."""
    if node.target != aten.rnn_relu.input:
        return False
    call = RecurrentCall.parse(node)
    return call.num_layers > 1 and not call.packed


def split_layers(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``node`` by one single-layer call per layer; ``h_n`` is their states joined.

    Used as an ``Annotation.decompose`` hook: the nodes added are annotated like any other.
    """
    x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = node.args
    assert isinstance(params, list | tuple) and isinstance(num_layers, int)
    dirs = 2 if bidirectional else 1
    per = len(params) // num_layers  # the weights of one layer, every direction
    graph = gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in node.all_input_nodes])

    def add(target, *args) -> fx.Node:
        new = graph.call_function(target, args)
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        vals = [[v.meta["val"] for v in a] if isinstance(a, list) else a for a in vals]
        if fake_mode is not None:
            with fake_mode:
                new.meta["val"] = target(*vals)
        return new

    states: list[fx.Node] = []
    out: fx.Node = x  # type: ignore[assignment]  # the input is a graph value
    with graph.inserting_before(node):
        for layer in range(num_layers):
            h0 = add(aten.slice.Tensor, hx, 0, layer * dirs, (layer + 1) * dirs)
            weights = list(params[layer * per : (layer + 1) * per])
            call = add(
                aten.rnn_relu.input, out, h0, weights, has_biases, 1, dropout, train,
                bidirectional, batch_first,
            )  # fmt: skip
            out = add(operator.getitem, call, 0)
            states.append(add(operator.getitem, call, 1))
        h_n = add(aten.cat.default, states, 0)
    for user in list(node.users):
        index = user.args[1] if user.target is operator.getitem else None
        assert index in (0, 1), f"{user} reads {node} other than by index"
        user.replace_all_uses_with(out if index == 0 else h_n)
        graph.erase_node(user)
    graph.erase_node(node)
    graph.lint()
    gm.recompile()
