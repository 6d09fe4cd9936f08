"""capture: a model becomes an ATen-level ``GraphModule`` through ``torch.export``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError


def capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
) -> fx.GraphModule:
    """Export ``model`` and return its graph with ``node.meta['val']`` on every node.

    Recurrent layers stay single ``aten.lstm``/``aten.gru``/``aten.rnn_*`` nodes, tuples come
    back as ``getitem`` chains. The model is not modified.

    torch.export fixes every input dimension to the example's and the graph checks it on
    each call; ``dynamic_shapes`` (as for ``torch.export.export``, e.g.
    ``{"x": {0: torch.export.Dim("batch")}}``) lets a dimension vary. Keyword example inputs
    make the graph take those keywords; calibrate it with ``(args, kwargs)`` pairs.
    """
    if not isinstance(example_args, tuple):
        raise QuantreeError(
            f"example_args must be a tuple of the model's positional arguments, got "
            f"{type(example_args).__name__}; write (x,) for a single input"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise QuantreeError(
            f"example_kwargs must be a dict of keyword arguments, got "
            f"{type(example_kwargs).__name__}; write {{'y': y}}"
        )
    if not isinstance(model, torch.nn.Module):
        raise QuantreeError(
            f"capture takes a torch.nn.Module, got {type(model).__name__}; for a saved program "
            "pass torch.export.load(path).module()"
        )
    was_training = model.training
    _set_training(model, False)
    try:
        with warnings.catch_warnings():
            # nn.RNNBase keeps a list of its weights that export reports as reassigned.
            warnings.filterwarnings("ignore", message=".*_flat_weights.*")
            program = torch.export.export(
                model, example_args, dict(example_kwargs or {}), dynamic_shapes=dynamic_shapes
            )
    except QuantreeError:
        raise  # raised by a capture-time hook inside the model: already says what to do
    except Exception as error:
        raise QuantreeError(
            f"torch.export could not capture {type(model).__name__}: {error}. quantree needs a "
            "model torch.export accepts; see the torch.export documentation for the fix"
        ) from error
    finally:
        _set_training(model, was_training)
    return program.module()


def _set_training(model: torch.nn.Module, mode: bool) -> None:
    """``model.train(mode)``; a module from ``ExportedProgram.module()`` refuses both modes.

    Such a module was captured by torch.export already (in the mode it was exported in,
    which its graph fixes), so it is captured again as it is.
    """
    try:
        model.train(mode)
    except NotImplementedError:
        if not isinstance(model, fx.GraphModule):
            raise
