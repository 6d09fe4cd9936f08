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
PADDED_OPS = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)
PACKED_OPS = (aten.lstm.data, aten.gru.data, aten.rnn_tanh.data, aten.rnn_relu.data)
"""``(data, batch_sizes, hx, params, ...)``: a packed sequence (see ``recurrent.packed``)."""
RECURRENT_OPS = PADDED_OPS + PACKED_OPS
"""The whole-layer recurrent calls, on a padded batch or a packed sequence."""
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
    """One whole-layer call. A packed call (``.data`` overload) reads its rows from the packed
    ``data`` and its per-step batch sizes from the int64 ``batch_sizes`` argument, which is
    never quantized; its arguments sit one place later and it has no ``batch_first``."""

    kind: str  # "lstm" | "gru" | "rnn_tanh" | "rnn_relu"
    state_paths: tuple[Path, ...]
    layers: tuple[LayerParams, ...]
    num_layers: int
    bidirectional: bool
    batch_first: bool
    has_biases: bool
    batch_sizes_path: Path | None = None  # (1,) for a packed call

    @property
    def packed(self) -> bool:
        return self.batch_sizes_path is not None

    @staticmethod
    def parse(node: fx.Node) -> RecurrentCall:
        kind = str(getattr(node.target, "__name__", node.target)).split(".")[0]
        if node.target not in RECURRENT_OPS:
            raise QuantreeError(f"node {node.name} ({node.target}) is not a recurrent call")
        packed = node.target in PACKED_OPS
        if packed:
            _, _, hx, params, has_biases, layers_arg, _, _, bidirectional = node.args
            batch_first: object = False
        else:
            _, hx, params, has_biases, layers_arg, _, _, bidirectional, batch_first = node.args
        at_hx, at_params = (2, 3) if packed else (1, 2)
        assert isinstance(params, list | tuple) and isinstance(layers_arg, int)
        num_layers = layers_arg
        state_paths: tuple[Path, ...] = (
            tuple((at_hx, i) for i in range(len(hx)))  # type: ignore[arg-type]
            if isinstance(hx, list | tuple)
            else ((at_hx,),)
        )
        dirs = 2 if bidirectional else 1
        per = len(params) // (num_layers * dirs)
        has_proj = per - 2 - (2 if has_biases else 0) == 1
        layers = []
        for i in range(num_layers * dirs):
            at: list[Path] = [(at_params, i * per + k) for k in range(per)]
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
            (1,) if packed else None,
        )
