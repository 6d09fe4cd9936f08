"""capture: ``quantree.core.capture`` plus what real models need that torch.export lacks.

The core captures any model torch.export accepts. Packed sequences (``pack_padded_sequence``
-> LSTM/GRU/RNN -> ``pad_packed_sequence``) need the recurrent wing's capture-time ops
(``quantree.recurrent.packed``), so the public ``capture`` composes the two here rather than
teaching the core about recurrent layers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from quantree.core import capture as core
from quantree.core.errors import QuantreeError
from quantree.recurrent.free_length import warn_pinned_lengths
from quantree.recurrent.packed import FIX, packed_sequences, restore_aten
from quantree.recurrent.unrolled.free import fold_and_free


def capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
    fold_loops: bool | None = None,
    free_chunks: bool | None = None,
) -> fx.GraphModule:
    """Export ``model`` to an ATen ``GraphModule`` (see ``quantree.core.capture.export_graph``).

    A recurrent layer run on a packed sequence becomes ``aten.lstm.data`` (``gru.data``,
    ``rnn_*.data``) between ``aten._pack_padded_sequence`` and ``aten._pad_packed_sequence``.

    A model with ``nn.LSTM``/``GRU``/``RNN`` modules is captured with every input dimension
    left to vary where the model allows it (see ``quantree.recurrent.free_length``), so it
    runs at any sequence length and batch; where the model pins a recurrent layer's length,
    one ``QuantreeWarning`` names the layer and the fix.

    A Python loop over time (a ``GRUCell`` stepped by hand, a sequential selective scan),
    which export unrolls into one copy of the step per time step, is folded back into one
    loop over the step graph (``quantree.recurrent.unrolled``): the step is quantized once and
    the loop runs at any length. By default (``None``) only loops whose step is a recurrent
    cell are folded (they run as one native program); a model with another loop keeps it
    unrolled, with one warning. ``fold_loops=True`` folds every loop, ``False`` none.
    A loop over chunks (a Python ``for`` over ``T // chunk`` windows: xLSTM's chunkwise
    mLSTM) is freed of its length when ``free_chunks`` (by default when ``fold_loops=True``):
    it then runs at every multiple of its chunk, slower at the captured length than the loop
    captured at a fixed length (its region programs split around the freed sizes).
    """
    if not isinstance(model, torch.nn.Module):  # the core's capture says what to pass
        return core.export_graph(model, example_args, example_kwargs)
    recurrent = any(isinstance(m, torch.nn.RNNBase) for m in model.modules())
    free = recurrent and dynamic_batch and dynamic_shapes is None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        gm, packed = _capture(model, example_args, example_kwargs, dynamic_shapes, dynamic_batch,
                              recurrent)  # fmt: skip
    if free and packed:  # packed sequences need the example's sizes, as export traced them
        # fresh copies: export marks the example tensors it made dynamic, for later exports too
        args, kwargs = tree_map(_copy, (example_args, example_kwargs))
        gm, _ = _capture(model, args, kwargs, None, False, False)
        return gm
    for w in said:  # said once: the capture that stands
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if free:
        warn_pinned_lengths(model, gm)
    if fold_loops is not False:

        def again(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> fx.GraphModule:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _capture(model, args, kwargs, dynamic_shapes, dynamic_batch, recurrent)[0]

        chunks = fold_loops is True if free_chunks is None else free_chunks
        gm = fold_and_free(
            gm, example_args, example_kwargs, again, every_loop=bool(fold_loops), free_chunks=chunks
        )
    return gm


def _capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    dynamic_shapes: Any,
    dynamic_batch: bool,
    every_dim: bool,
) -> tuple[fx.GraphModule, list[str]]:
    """The graph, and the recurrent modules that ran on a packed sequence."""
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
    return gm, list(packed)


def _copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x
