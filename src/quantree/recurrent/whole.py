"""Whole mode: a recurrent layer, or one step of it, quantized at its boundary.

A backend decides how it computes inside (a native int8 kernel, an NPU op); the annotation
only fixes the grids of what crosses the boundary.
"""

from __future__ import annotations

import torch.fx as fx

from quantree.core.quantizer import Annotation
from quantree.core.specs import (
    DerivedSpec,
    QuantSpec,
    SharedSpec,
    Spec,
    bias_spec,
    product_of_scales,
)
from quantree.core.values import Path, Use, Value
from quantree.recurrent.call import RecurrentCall
from quantree.recurrent.state_observer import state_spec


def recurrent_whole_annotation(
    node: fx.Node,
    act: QuantSpec,
    weight: QuantSpec,
    share_state: bool = False,
    sequence: QuantSpec | None = None,
) -> Annotation:
    """Quantize a recurrent layer at its boundary.

    Input, initial states, weights (per channel) and every output leaf are quantized; biases
    are int32 with scale input x weight. A layer above the first reads the previous layer's
    output, which whole mode does not expose, so its input-side bias derives from the
    layer's output Value, which holds the same kind of tensor.

    Each returned state has its own grid, observed on what the layer returns (an initial
    state drawn wider than the state's own range would otherwise coarsen it), and the
    initial state is requantized at the boundary. ``share_state`` puts each returned state
    on its initial state's grid instead, for stateful streaming, where the returned state is
    the next call's initial state and one grid avoids a requantization per call.

    The output sequence (every step's hidden state, which the next step reads back) and the
    states are calibrated on their extremes whatever ``act``'s observer (``state_observer``).

    ``sequence``, when given, is the spec of the input and output sequences instead of
    ``act`` (the int8 recipe's ``recurrent_sequence_dtype``: int16, where the int8 output
    grid was most of a layer's error).
    """
    call = RecurrentCall.parse(node)
    state = state_spec(act)
    inputs: dict[Path, Spec] = {(0,): sequence or act}
    for path in call.state_paths:
        inputs[path] = state
    input_use = Use.of(node, (0,))
    output = Value(node, (0,))
    hidden_use = Use.of(node, call.state_paths[0])
    for p in call.layers:
        for w in (p.w_ih, p.w_hh, p.w_hr):
            if w is not None:
                inputs[w] = weight
        if p.b_ih is not None:
            inputs[p.b_ih] = (
                bias_spec(input_use, Use.of(node, p.w_ih))
                if p.layer == 0
                else DerivedSpec((output, Use.of(node, p.w_ih)), product_of_scales)
            )
        if p.b_hh is not None:
            inputs[p.b_hh] = bias_spec(hidden_use, Use.of(node, p.w_hh))
    states = tuple(
        SharedSpec(Use.of(node, path)) if share_state else state for path in call.state_paths
    )
    sequence_out = state_spec(sequence) if sequence is not None else state
    return Annotation(outputs=(sequence_out, *states), inputs=inputs, name=call.kind)


def recurrent_cell_annotation(node: fx.Node, act: QuantSpec, weight: QuantSpec) -> Annotation:
    """One step (``nn.LSTMCell`` / ``GRUCell`` / ``RNNCell``) quantized at its boundary.

    ``aten.lstm_cell(x, [h, c], w_ih, w_hh, b_ih, b_hh)`` and the single-state cells
    ``(x, h, w_ih, w_hh, b_ih, b_hh)``: biases derive from x and h, each new state shares its
    incoming state's parameters so a loop of cells keeps one scale per state, calibrated on
    its extremes (``state_observer``).
    """
    hx = node.args[1]
    state_paths: tuple[Path, ...] = (
        tuple((1, i) for i in range(len(hx))) if isinstance(hx, list | tuple) else ((1,),)
    )
    inputs: dict[Path, Spec] = {(0,): act, (2,): weight, (3,): weight}
    inputs.update(dict.fromkeys(state_paths, state_spec(act)))
    if len(node.args) > 4 and isinstance(node.args[4], fx.Node):
        inputs[(4,)] = bias_spec(Use.of(node, (0,)), Use.of(node, (2,)))
    if len(node.args) > 5 and isinstance(node.args[5], fx.Node):
        inputs[(5,)] = bias_spec(Use.of(node, state_paths[0]), Use.of(node, (3,)))
    states = tuple(SharedSpec(Use.of(node, path)) for path in state_paths)
    return Annotation(outputs=states if len(states) > 1 else states[0], inputs=inputs)
