"""A stacked recurrent call split into one call per layer, so each layer's output is observed.

Whole mode observes a recurrent call's boundary only. The hidden states of the layers below
the last are never observed, and a backend must then bound them for any input: tanh, LSTM
and GRU states are bounded, a ReLU RNN's are not, so the CPU backend left a stacked
``nn.RNN(nonlinearity="relu")`` as the reference computes it (a float RNN that dequantized
its int8 weights on every call, slower than float). One ``aten.rnn_relu`` per layer computes
the same thing (PyTorch runs the layers one after another too) and makes each layer's
output an ordinary Value: observed, quantized, and each call one native layer.

The same holds for LSTM, GRU and tanh RNN stacks, whose inner states are bounded: left whole,
the CPU backend carries them at int16 (a bound that holds for any input, or the range the
call took), which costs two byte-plane passes of the next layer's input and of the inner
layers' recurrent products. Observed, each boundary is one int8 tensor like any other: on
random-weight stacks that traded a little SQNR for a clear saving of time
(benchmarks/README.md, "Stacked layers split per layer").
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from quantree.core.stages import VALUE_OF_KEY
from quantree.recurrent.call import PACKED_OPS, RecurrentCall

aten = torch.ops.aten


SPLIT_LAYER_KEY = "quantree_split_layer"
"""Node meta of each layer call but the last: its index in the stack (tools name its output
``output l0``, ...; the last layer's output is the stacked call's)."""

SPLITTABLE = (
    aten.rnn_relu.input,
    aten.rnn_tanh.input,
    aten.gru.input,
    aten.lstm.input,
    *PACKED_OPS,
)
RELU_ONLY = (aten.rnn_relu.input, aten.rnn_relu.data)
"""What is split with ``split_layers=False``: nothing bounds a ReLU RNN's inner states."""


def layer_name(name: str, layer: int) -> str:
    """The node name of layer ``layer`` of stacked call ``name`` once split."""
    return f"{name}_l{layer}"


def splittable(node: fx.Node, kinds: tuple[object, ...] = RELU_ONLY) -> bool:
    """A recurrent call (padded, or packed: the ``.data`` overloads) of more than one layer,
    of one of ``kinds``."""
    if node.target not in kinds:
        return False
    return RecurrentCall.parse(node).num_layers > 1


def split_layers(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``node`` by one single-layer call per layer; ``h_n`` is their states joined.

    Used as an ``Annotation.decompose`` hook: the nodes added are annotated like any other.
    """
    packed = node.target in PACKED_OPS  # (data, batch_sizes, hx, ...): no batch_first
    if packed:
        x, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional = (
            node.args
        )
    else:
        x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = (
            node.args
        )
    assert isinstance(params, list | tuple) and isinstance(num_layers, int)
    dirs = 2 if bidirectional else 1
    per = len(params) // num_layers  # the weights of one layer, every direction
    graph = gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in node.all_input_nodes])

    def add(target, *args, val: object = None, name: str | None = None) -> fx.Node:
        new = graph.create_node("call_function", target, args, name=name)
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        vals = [[v.meta["val"] for v in a] if isinstance(a, list) else a for a in vals]
        if val is not None:
            new.meta["val"] = val
        elif fake_mode is not None:
            with fake_mode:
                new.meta["val"] = target(*vals)
        return new

    # A layer's values, read off the stacked call's: every layer's output has the last one's
    # shape (one hidden size), its states are its rows of h_n / c_n. Running the op's fake
    # kernel instead fails on a dynamic batch (ATen's lstm reads ``numel()`` of a symbol).
    whole = node.meta.get("val")

    def layer_val(layer: int) -> object:
        if whole is None or fake_mode is None:
            return None
        with fake_mode:
            states = (s[layer * dirs : (layer + 1) * dirs] for s in whole[1:])
            return (torch.empty_like(whole[0]), *states)

    def layer_state(h: fx.Node, layer: int) -> fx.Node:
        """A layer's rows of an initial state: fresh zeros where the state is zeros (as
        export writes a call without one: no float slice op to report), else a slice."""
        if h.target == aten.zeros.default and not h.kwargs.get("out"):
            shape = h.args[0]
            assert isinstance(shape, list | tuple)
            state = graph.create_node(
                "call_function", aten.zeros.default, ([dirs, *shape[1:]], *h.args[1:]), h.kwargs
            )
            state.meta = dict(h.meta)
            if fake_mode is not None and "val" in h.meta:
                with fake_mode:
                    state.meta["val"] = h.meta["val"][:dirs].clone()
            return state
        return add(aten.slice.Tensor, h, 0, layer * dirs, (layer + 1) * dirs)

    hs = [h for h in (hx if isinstance(hx, list | tuple) else [hx]) if isinstance(h, fx.Node)]
    assert len(hs) in (1, 2), f"{node}: initial states are not graph values"  # LSTM: [h0, c0]
    n_states = len(hs)
    states: list[list[fx.Node]] = [[] for _ in range(n_states)]
    out: fx.Node = x  # type: ignore[assignment]  # the input is a graph value
    with graph.inserting_before(node):
        for layer in range(num_layers):
            h0 = [layer_state(h, layer) for h in hs]
            weights = list(params[layer * per : (layer + 1) * per])
            state = h0 if isinstance(hx, list | tuple) else h0[0]
            rest = (has_biases, 1, dropout, train, bidirectional)
            args = (
                (out, batch_sizes, state, weights, *rest)
                if packed
                else (out, state, weights, *rest, batch_first)
            )
            call = add(node.target, *args, val=layer_val(layer), name=layer_name(node.name, layer))
            if layer < num_layers - 1:
                call.meta[SPLIT_LAYER_KEY] = layer
            out = add(operator.getitem, call, 0)
            for i in range(n_states):
                states[i].append(add(operator.getitem, call, 1 + i))
        finals = [add(aten.cat.default, s, 0) for s in states]
    results = [out, *finals]
    for leaf, result in enumerate(results):  # the stacked call's leaves, for tools
        result.meta[VALUE_OF_KEY] = (node.name, (leaf,))
    for user in list(node.users):
        index = user.args[1] if user.target is operator.getitem else None
        assert isinstance(index, int) and 0 <= index <= n_states, f"{user} reads {node} by {index}"
        user.replace_all_uses_with(results[index])
        graph.erase_node(user)
    graph.erase_node(node)
    for h in hs:  # zeros replaced by each layer's own: nothing reads them now
        if h.target == aten.zeros.default and not h.users:
            graph.erase_node(h)
    graph.lint()
    gm.recompile()
