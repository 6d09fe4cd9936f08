"""Whole-mode recurrent layers as ONE ``quantree_et::rnn`` node each, for ExecuTorch.

XNNPACK has no recurrent op, int8 or float. Two ways were tried to run a quantized layer
in int8 in ExecuTorch:

- **XNNPACK's dynamically quantized linears, unrolled** (the previous version of this
  module): the input projection of all steps as one int8 linear, then per step the
  recurrent product as an int8 linear and the gate math as XNNPACK ops. The program grows
  with the sequence length: ExecuTorch's lowering of a T128 LSTM took 26 minutes and its
  runtime crashed, and each step pays delegate calls and a dynamic requantization of h.
- **A kernel library** (this module and ``csrc/quantree_et_kernels.cpp``): the layer is the
  custom operator ``quantree_et::rnn``, whose ExecuTorch kernel calls the same C++ core as
  quantree's CPU backend, so the time loop runs inside one kernel call (lowering time and
  program size do not depend on T) and the numbers are the CPU backend's. The price: a
  runtime running the ``.pte`` links quantree's kernel library (Python: ``kernels.load``,
  which ``run_executorch`` does; C++: docs/deployment-executorch.md).

The layer is lowered by the CPU backend's own rule (``rules/recurrent/layers.lower_recurrent``:
the same pattern, packed weights, grids of the inner and fed-back states, fused float
input and output), then its ``quantree.rnn`` node is re-expressed as ``quantree_et::rnn``
(time-major, a batch-first layer transposed around it). The rest of the graph is left to
XNNPACK. A packed sequence stays as the reference (float in ExecuTorch, with a warning).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu.rules.recurrent.layers import lower_recurrent
from quantree.backends.executorch.rnn_op import KINDS, RNN
from quantree.core.lower import Backend, LoweringContext
from quantree.recurrent.call import PADDED_OPS

aten = torch.ops.aten
CPU_RNN = torch.ops.quantree.rnn.default
BATCH_FIRST_KEY = "quantree_et_batch_first"
"""``node.meta`` key of the transpose that makes a layer's time-major output batch-first."""
HIDDEN_BITS = 8
"""The hidden state fed back as int8, the CPU backend's default (``recurrent_rule``)."""


def lower_layers(gm: fx.GraphModule) -> list[str]:
    """Replace each int8 whole-mode layer of ``gm`` by ``quantree_et::rnn``, in place; the
    names of the layers replaced. A layer the CPU rule does not take stays as it is."""
    ctx = LoweringContext(gm, Backend("executorch-recurrent"))
    lowered = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in PADDED_OPS:
            name = node.name
            if lower_recurrent(ctx, node, hidden_bits=HIDDEN_BITS):
                lowered.append(name)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == CPU_RNN:
            to_executorch_op(gm.graph, node)
    return lowered


def to_executorch_op(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``quantree.rnn(...)`` as ``quantree_et::rnn``, with the same outputs."""
    args: Any = node.args
    kind, x, hx, params, hidden, layers, bidirectional, batch_first, qparams = args[:9]
    bits, proj, float_in, float_out = args[9:13]
    config = [KINDS.index(kind), hidden, layers, 2 if bidirectional else 1, bits, proj]
    config += [int(bool(float_in)), int(bool(float_out))]
    x_bits, y_bits = (*args[13:15], 8, 8)[:2]
    if (x_bits, y_bits) != (8, 8):  # int16 sequences: the longer config
        config += [int(x_bits), int(y_bits)]
    h0 = hx[0] if hx else None
    c0 = hx[1] if len(hx) > 1 else None
    with graph.inserting_before(node):
        # the kernel reads time-major rows (ExecuTorch makes a transpose a dense copy); a
        # batch-first layer reading another's output reads its time-major output directly
        if not batch_first:
            seq = x
        elif isinstance(x, fx.Node) and x.meta.get(BATCH_FIRST_KEY):
            seq = x.args[0]
        else:
            seq = graph.call_function(aten.transpose.int, (x, 0, 1))
        new = graph.call_function(RNN, (seq, h0, c0, list(params), config, list(qparams)))
    new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise TypeError(f"{user} reads {node} whole")
        with graph.inserting_before(user):
            leaf = graph.call_function(operator.getitem, (new, user.args[1]))
            if batch_first and user.args[1] == 0:
                leaf = graph.call_function(aten.transpose.int, (leaf, 0, 1))
                leaf.meta[BATCH_FIRST_KEY] = True
        leaf.meta.update(user.meta)
        user.replace_all_uses_with(leaf)
        graph.erase_node(user)
    graph.erase_node(node)
    return new
