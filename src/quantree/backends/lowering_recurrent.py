"""Lowering rule for whole-mode LSTM / GRU / RNN layers onto ``torch.ops.quantree.rnn``.

Pattern: ``aten.lstm|gru|rnn_*`` whose input and initial states are read through int8
dequantize, whose weights are folded int8 and biases folded int32, and whose every used
output leaf is quantized. Inside, the kernel keeps the cell state in float and requantizes
the hidden state it feeds back (and the outputs passed between stacked layers) to int8 with
one "inner" scale covering both the layer's observed output range and its state range.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from quantree.backend import LoweringContext, Quantized
from quantree.backends import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.packing import pack, zero_point_offset
from quantree.backends.patterns import (
    Activation,
    activation,
    constant,
    float_constant,
    is_int8_per_tensor,
    weight,
)
from quantree.recurrent import RecurrentCall
from quantree.values import arg_at

aten = torch.ops.aten
RECURRENT = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)


def inner_params(ranges: list[tuple[float, float]]) -> tuple[float, int]:
    """int8 affine (scale, zero point) covering every (low, high) range and zero."""
    lo = min(0.0, *(r[0] for r in ranges))
    hi = max(0.0, *(r[1] for r in ranges))
    scale = max(hi - lo, 1e-8) / 255.0
    zero_point = int(max(-128, min(127, round(-128 - lo / scale))))
    return scale, zero_point


def _range(scale: float, zero_point: int) -> tuple[float, float]:
    return (-128 - zero_point) * scale, (127 - zero_point) * scale


def _outputs(ctx: LoweringContext, node: fx.Node) -> dict[int, Quantized] | None:
    """The quantize of each output leaf; None if some used leaf is not int8-quantized."""
    found: dict[int, Quantized] = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        q = ctx.quantized_output(user)
        if q is None or not is_int8_per_tensor(q.params):
            return None
        found[int(user.args[1])] = q  # type: ignore[arg-type]
    return found if 0 in found else None


def _layer_params(
    ctx: LoweringContext,
    node: fx.Node,
    call: RecurrentCall,
    x: Activation,
    inner: tuple[float, int],
) -> list[fx.Node] | None:
    params: list[fx.Node] = []
    for p in call.layers:
        w_ih, w_hh = weight(ctx, arg_at(node, p.w_ih)), weight(ctx, arg_at(node, p.w_hh))
        if w_ih is None or w_hh is None:
            return None
        n = w_ih.values.shape[0]
        b_ih = float_constant(ctx, None if p.b_ih is None else arg_at(node, p.b_ih), n)
        b_hh = float_constant(ctx, None if p.b_hh is None else arg_at(node, p.b_hh), n)
        if b_ih is None or b_hh is None:
            return None
        in_scale, in_zp = (x.scale, x.zero_point) if p.layer == 0 else inner
        tensors = (
            pack(w_ih.values),
            zero_point_offset(w_ih.values, in_zp),
            (in_scale * w_ih.scale).float(),
            b_ih,
            pack(w_hh.values),
            zero_point_offset(w_hh.values, inner[1]),
            (inner[0] * w_hh.scale).float(),
            b_hh,
        )
        params += [constant(ctx, f"_cpu_{call.kind}_", t, node) for t in tensors]
    return params


def lower_recurrent(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target not in RECURRENT:
        return False
    call = RecurrentCall.parse(node)
    if any(p.w_hr is not None for p in call.layers):
        return False  # LSTM projections stay in the reference graph
    x = activation(ctx, node.args[0])
    states = [activation(ctx, arg_at(node, path)) for path in call.state_paths]
    outputs = _outputs(ctx, node)
    if x is None or outputs is None or any(s is None for s in states):
        return False
    h0 = states[0]
    assert h0 is not None
    c0 = states[1] if len(states) > 1 else h0
    assert c0 is not None
    y = outputs[0].params
    y_s, y_z = float(y.scale), int(y.zero_point)
    inner = inner_params([_range(y_s, y_z), _range(h0.scale, h0.zero_point)])
    params = _layer_params(ctx, node, call, x, inner)
    if params is None:
        return False
    w_hh = weight(ctx, arg_at(node, call.layers[0].w_hh))
    assert w_hh is not None
    hidden = int(w_hh.values.shape[1])
    qparams = [inner[0], inner[1], y_s, y_z, h0.scale, h0.zero_point, c0.scale, c0.zero_point]
    hx = [s.node for s in states if s is not None]
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(
            torch.ops.quantree.rnn.default,
            (call.kind, x.node, hx, params, hidden, call.num_layers, call.bidirectional,
             call.batch_first, [float(v) for v in qparams]),
        )  # fmt: skip
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    for index, q in outputs.items():
        with graph.inserting_before(q.node):
            leaf = graph.call_function(operator.getitem, (new, index))
        q.node.replace_all_uses_with(leaf)
        graph.erase_node(q.node)
    for user in list(node.users):
        graph.erase_node(user)
    graph.erase_node(node)
    return True

