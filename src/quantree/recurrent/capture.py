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

    ``dynamic_batch`` (see the core's ``capture``) applies to models without ``nn.LSTM``/
    ``GRU``/``RNN`` modules: export pins their sequence length and packed sequences need
    the example's sizes; give those ``dynamic_shapes`` to make a dimension vary.
    """
    recurrent = any(isinstance(m, torch.nn.RNNBase) for m in model.modules())
    return _capture(
        model, example_args, example_kwargs, dynamic_shapes, dynamic_batch and not recurrent
    )


def _capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    dynamic_shapes: Any,
    dynamic_batch: bool,
) -> fx.GraphModule:
    with packed_sequences(model) as packed:
        try:
            gm = core.export_graph(
                model,
                example_args,
                example_kwargs,
                dynamic_shapes=dynamic_shapes,
                dynamic_batch=dynamic_batch,
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
