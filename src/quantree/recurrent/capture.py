"""capture: ``quantree.core.capture`` plus what real models need that torch.export lacks.

The core captures any model torch.export accepts. Packed sequences (``pack_padded_sequence``
-> LSTM/GRU/RNN -> ``pad_packed_sequence``) need the recurrent wing's capture-time ops
(``quantree.recurrent.packed``), so the public ``capture`` composes the two here rather than
teaching the core about recurrent layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from quantree.core import capture as core
from quantree.core.errors import QuantreeError
from quantree.recurrent.free_length import warn_pinned_lengths
from quantree.recurrent.packed import FIX, packed_sequences, restore_aten


def capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
) -> fx.GraphModule:
    """Export ``model`` to an ATen ``GraphModule`` (see ``quantree.core.capture.export_graph``).

    A recurrent layer run on a packed sequence becomes ``aten.lstm.data`` (``gru.data``,
    ``rnn_*.data``) between ``aten._pack_padded_sequence`` and ``aten._pad_packed_sequence``.

    A model with ``nn.LSTM``/``GRU``/``RNN`` modules is captured with every input dimension
    left to vary where the model allows it (see ``quantree.recurrent.free_length``), so it
    runs at any sequence length and batch; where the model pins a recurrent layer's length,
    one ``QuantreeWarning`` names the layer and the fix.
    """
    recurrent = any(isinstance(m, torch.nn.RNNBase) for m in model.modules())
    gm = _capture(model, example_args, example_kwargs, dynamic_shapes, dynamic_batch, recurrent)
    if recurrent and dynamic_batch and dynamic_shapes is None:
        warn_pinned_lengths(model, gm)
    return gm


def _capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    dynamic_shapes: Any,
    dynamic_batch: bool,
    every_dim: bool,
) -> fx.GraphModule:
    with packed_sequences(model) as packed:
        try:
            gm = core.export_graph(
                model,
                example_args,
                example_kwargs,
                dynamic_shapes=dynamic_shapes,
                dynamic_batch=dynamic_batch,
                every_dim=every_dim,
            )
        except QuantreeError as error:
            if not packed or "packed sequence" in str(error):
                raise
            raise QuantreeError(
                f"{error}\n(modules {', '.join(packed)} run on a packed sequence; if the "
                f"packing is what export refuses: {FIX})"
            ) from error
    restore_aten(gm)
    return gm
