"""Lowering rule for one recurrent step (``nn.LSTMCell`` / ``GRUCell`` / ``RNNCell``).

Pattern: ``aten.lstm_cell|gru_cell|rnn_tanh_cell|rnn_relu_cell`` whose input and states are
read through int8 dequantize, whose weights are folded int8 and biases folded int32 (or
absent), and whose every used output is quantized to int8: one ``quantree.rnn_cell`` call,
the whole-layer kernel run for one step. Decoders that call a cell once per generated frame
(Tacotron2's attention and decoder LSTM cells) then never dequantize their weights.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from quantree.backends.cpu.ops.recurrent import rnn_cell as ops_rnn_cell  # noqa: F401  (registers the op)
from quantree.backends.cpu.saved.derived import bias_recipe, derived_constant, packed_and_sums
from quantree.backends.patterns import (
    Activation,
    activation,
    float_constant,
    is_int8_per_tensor,
    mark_provenance,
    weight,
)
from quantree.core.lower import LoweringContext, Quantized
from quantree.recurrent.call import CELL_OPS

aten = torch.ops.aten
KINDS = {
    aten.lstm_cell.default: "lstm",
    aten.gru_cell.default: "gru",
    aten.rnn_tanh_cell.default: "rnn_tanh",
    aten.rnn_relu_cell.default: "rnn_relu",
}


def _outputs(ctx: LoweringContext, node: fx.Node, lstm: bool) -> dict[int, Quantized] | None:
    """The int8 quantize of each used output (0: h', 1: c'); None if one is not int8."""
    found: dict[int, Quantized] = {}
    leaves = (
        [(int(u.args[1]), u) for u in node.users if u.target is operator.getitem]  # type: ignore[arg-type]
        if lstm
        else [(0, node)]
    )
    if lstm and len(leaves) != len(node.users):
        return None
    for index, leaf in leaves:
        if not leaf.users:
            continue
        q = ctx.quantized_output(leaf)
        if q is None or not is_int8_per_tensor(q.params):
            return None
        found[index] = q
    return found or None


def lower_cell(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target not in CELL_OPS:
        return False
    kind = KINDS[node.target]  # type: ignore[index]
    lstm = kind == "lstm"
    args = list(node.args) + [None] * (6 - len(node.args))
    x = activation(ctx, args[0])
    hx = args[1] if isinstance(args[1], list | tuple) else [args[1]]
    states = [activation(ctx, s, True) for s in hx]
    outputs = _outputs(ctx, node, lstm)
    w_ih, w_hh = weight(ctx, args[2]), weight(ctx, args[3])
    if x is None or outputs is None or w_ih is None or w_hh is None:
        return False
    if any(s is None for s in states) or len(states) != (2 if lstm else 1):
        return False
    n = int(w_ih.values.shape[0])
    b_ih, b_hh = float_constant(ctx, args[4], n), float_constant(ctx, args[5], n)
    if b_ih is None or b_hh is None or w_ih.values.dim() != 2:
        return False
    hidden = int(w_hh.values.shape[1])
    h: Activation = states[0]  # type: ignore[assignment]
    c: Activation = states[-1]  # type: ignore[assignment]
    grids = [(x.scale, x.zero_point), (h.scale, h.zero_point), (c.scale, c.zero_point)]
    for index, state in ((0, h), (1, c)):  # an unused output keeps its state's grid
        out = outputs.get(index)
        grids.append(
            (float(out.params.scale), int(out.params.zero_point))
            if out
            else (state.scale, state.zero_point)
        )
    tensors = [
        *packed_and_sums(w_ih.values), w_ih.scale, b_ih,
        *packed_and_sums(w_hh.values), w_hh.scale, b_hh,
    ]  # fmt: skip
    graph = ctx.gm.graph
    recipes = {3: bias_recipe(ctx, args[4]), 7: bias_recipe(ctx, args[5])}  # per call site
    params = [
        derived_constant(ctx, f"_cpu_{kind}_cell_", t, node, recipes.get(i))
        for i, t in enumerate(tensors)
    ]
    qparams = [float(v) for grid in grids for v in grid]
    with graph.inserting_before(node):
        new = graph.call_function(
            torch.ops.quantree.rnn_cell.default,
            (kind, x.node, [s.node for s in states if s is not None], params, hidden, qparams),
        )
    new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    for index, q in outputs.items():
        with graph.inserting_before(q.node):
            leaf = graph.call_function(operator.getitem, (new, index))
        mark_provenance(q.node, leaf)  # the numeric debugger reads the kernel's output
        q.node.replace_all_uses_with(leaf)
        graph.erase_node(q.node)
    for user in list(node.users):
        if not user.users:
            graph.erase_node(user)
    if not node.users:
        graph.erase_node(node)
    return True
