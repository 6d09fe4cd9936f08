"""Recurrent layers (``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``) read as data.

``RecurrentCall`` parses the ATen call once: which argument is which state, which flat
parameter is which layer's weight or bias. Whole-mode annotation (``whole``), cells mode
(``decompose``) and the CPU backend's recurrent kernels all read the same description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.values import Path

aten = torch.ops.aten
RECURRENT_OPS = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)
"""The whole-layer recurrent calls (padded input; ``.data`` overloads are packed sequences)."""
CELL_OPS = (
    aten.lstm_cell.default,
    aten.gru_cell.default,
    aten.rnn_tanh_cell.default,
    aten.rnn_relu_cell.default,
)
"""One time step: ``nn.LSTMCell`` / ``GRUCell`` / ``RNNCell``."""


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
        if node.target not in RECURRENT_OPS:
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
