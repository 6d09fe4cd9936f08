"""Recurrent layers (``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``) read as data.

``RecurrentCall`` parses the ATen call once: which argument is which state, which flat
parameter is which layer's weight or bias. Whole-mode annotation is a few lines on top of
it; cells mode decomposes the same description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from quantree.errors import QuantreeError
from quantree.quantizer import Annotation
from quantree.specs import DerivedSpec, QuantSpec, SharedSpec, Spec, bias_spec, product_of_scales
from quantree.values import Path, Use, Value

aten = torch.ops.aten


@dataclass(frozen=True)
class LayerParams:
    """Argument paths of one layer and direction's parameters (None when absent)."""

    layer: int
    direction: int
    w_ih: Path
    w_hh: Path
    b_ih: Path | None
    b_hh: Path | None
    w_hr: Path | None


@dataclass(frozen=True)
class RecurrentCall:
    kind: str  # "lstm" | "gru" | "rnn_tanh" | "rnn_relu"
    state_paths: tuple[Path, ...]
    layers: tuple[LayerParams, ...]
    num_layers: int
    bidirectional: bool
    batch_first: bool
    has_biases: bool

    @staticmethod
    def parse(node: fx.Node) -> RecurrentCall:
        kind = str(getattr(node.target, "__name__", node.target)).split(".")[0]
        if node.target not in (
            aten.lstm.input,
            aten.gru.input,
            aten.rnn_tanh.input,
            aten.rnn_relu.input,
        ):
            raise QuantreeError(
                f"node {node.name} ({node.target}) is not a supported recurrent call; packed "
                "sequences (the .data overloads) are not supported, pad the batch instead"
            )
        _, hx, params, has_biases, layers_arg, _, _, bidirectional, batch_first = node.args
        assert isinstance(params, list | tuple) and isinstance(layers_arg, int)
        num_layers = layers_arg
        state_paths: tuple[Path, ...] = (
            tuple((1, i) for i in range(len(hx)))  # type: ignore[arg-type]
            if isinstance(hx, list | tuple)
            else ((1,),)
        )
        dirs = 2 if bidirectional else 1
        per = len(params) // (num_layers * dirs)
        has_proj = per - 2 - (2 if has_biases else 0) == 1
        layers = []
        for i in range(num_layers * dirs):
            at: list[Path] = [(2, i * per + k) for k in range(per)]
            b_ih, b_hh = (at[2], at[3]) if has_biases else (None, None)
            w_hr = at[-1] if has_proj else None
            layers.append(LayerParams(i // dirs, i % dirs, at[0], at[1], b_ih, b_hh, w_hr))
        return RecurrentCall(
            kind,
            state_paths,
            tuple(layers),
            num_layers,
            bool(bidirectional),
            bool(batch_first),
            bool(has_biases),
        )


def recurrent_whole_annotation(node: fx.Node, act: QuantSpec, weight: QuantSpec) -> Annotation:
    """Quantize a recurrent layer at its boundary.

    Input, initial states, weights (per channel) and every output leaf are quantized; biases
    are int32 with scale input x weight. A layer above the first reads the previous layer's
    output, which whole mode does not expose, so its input-side bias derives from the
    layer's output Value, which holds the same kind of tensor. Each returned state shares
    one scale with its initial state.
    """
    call = RecurrentCall.parse(node)
    inputs: dict[Path, Spec] = {(0,): act}
    for path in call.state_paths:
        inputs[path] = act
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
    states = tuple(SharedSpec(Use.of(node, path)) for path in call.state_paths)
    return Annotation(outputs=(act, *states), inputs=inputs, name=call.kind)


CELL_OPS = (
    aten.lstm_cell.default,
    aten.gru_cell.default,
    aten.rnn_tanh_cell.default,
    aten.rnn_relu_cell.default,
)


def recurrent_cell_annotation(node: fx.Node, act: QuantSpec, weight: QuantSpec) -> Annotation:
    """One step (``nn.LSTMCell`` / ``GRUCell`` / ``RNNCell``) quantized at its boundary.

    ``aten.lstm_cell(x, [h, c], w_ih, w_hh, b_ih, b_hh)`` and the single-state cells
    ``(x, h, w_ih, w_hh, b_ih, b_hh)``: biases derive from x and h, each new state shares its
    incoming state's parameters so a loop of cells keeps one scale per state.
    """
    hx = node.args[1]
    state_paths: tuple[Path, ...] = (
        tuple((1, i) for i in range(len(hx))) if isinstance(hx, list | tuple) else ((1,),)
    )
    inputs: dict[Path, Spec] = {(0,): act, (2,): weight, (3,): weight}
    inputs.update(dict.fromkeys(state_paths, act))
    if len(node.args) > 4 and isinstance(node.args[4], fx.Node):
        inputs[(4,)] = bias_spec(Use.of(node, (0,)), Use.of(node, (2,)))
    if len(node.args) > 5 and isinstance(node.args[5], fx.Node):
        inputs[(5,)] = bias_spec(Use.of(node, state_paths[0]), Use.of(node, (3,)))
    states = tuple(SharedSpec(Use.of(node, path)) for path in state_paths)
    return Annotation(outputs=states if len(states) > 1 else states[0], inputs=inputs)
