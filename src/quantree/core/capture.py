"""capture: a model becomes an ATen-level ``GraphModule`` through ``torch.export``."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_map

from quantree.core.data_dependent import export_on_example_values
from quantree.core.errors import QuantreeError
from quantree.core.shape_guards import explain_shape_guards


def capture(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
) -> fx.GraphModule:
    """Export ``model`` and return its graph with ``node.meta['val']`` on every node.

    Recurrent layers stay single ``aten.lstm``/``aten.gru``/``aten.rnn_*`` nodes, tuples come
    back as ``getitem`` chains. The model is not modified.

    torch.export fixes every input dimension to the example's and the graph checks it on
    each call; ``dynamic_shapes`` (as for ``torch.export.export``, e.g.
    ``{"x": {0: torch.export.Dim("batch")}}``) lets a dimension vary. Keyword example inputs
    make the graph take those keywords; calibrate it with ``(args, kwargs)`` pairs.

    Without ``dynamic_shapes``, the first dimension of every tensor input is left to vary
    where the model allows it (``torch.export.Dim.AUTO``: export keeps it symbolic unless the
    model fixes it, as an LSTM does with its sequence length, or the example has size 0 or
    1), so a model calibrated on batches of 8 runs on a batch of 1. ``dynamic_batch=False``
    fixes every dimension to the example's.
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
            example_args, kwargs = unaliased(example_args, dict(example_kwargs or {}))
            try:
                program = _export(model, example_args, kwargs, dynamic_shapes, dynamic_batch)
            except GuardOnDataDependentSymNode as refused:  # Python read a tensor's value
                program = export_on_example_values(
                    model, example_args, kwargs, dynamic_shapes, refused
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
    return explain_shape_guards(program.module())


def unaliased(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The example inputs with each tensor that shares storage with an earlier one cloned.

    torch.export (2.13) traces inputs that alias as one: ``model(x, x)`` is captured as a
    graph that reads its last such input for all of them, which computes wrong (silently)
    once the inputs differ. The copies hold the same values; the user's tensors are not
    touched.
    """
    seen: set[tuple[torch.device, int]] = set()

    def distinct(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        key = (x.device, x.untyped_storage().data_ptr())
        if key in seen and x.numel():
            return x.clone()
        seen.add(key)
        return x

    return tree_map(distinct, args), tree_map(distinct, kwargs)


def batch_dims(example_args: tuple[Any, ...], example_kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` marking dim 0 of every tensor input ``Dim.AUTO``, shaped like the
    inputs (None for what is not a tensor)."""

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {0: torch.export.Dim.AUTO} if x.dim() > 0 else None
        if isinstance(x, list | tuple):
            return type(x)(spec(v) for v in x)
        if isinstance(x, dict):
            return {k: spec(v) for k, v in x.items()}
        return None

    return (*(spec(a) for a in example_args), *(spec(v) for v in example_kwargs.values()))


def batch_dims_by_name(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``batch_dims`` keyed by the names of ``model.forward``'s parameters.

    torch.export matches a tuple of dynamic shapes to the named parameters, not to the
    arguments: a ``forward(self, *inputs)`` (one parameter) given one entry per input was
    refused, and capture fell back to fixing every batch. By name, ``*inputs`` gets a tuple
    of entries and ``**options`` a dict of them.
    """
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):  # no signature to bind: as the arguments come
        return batch_dims(args, kwargs)
    return {name: batch_dims((value,), {})[0] for name, value in bound.arguments.items()}


def _export(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
    dynamic_batch: bool,
) -> torch.export.ExportedProgram:
    """Export, with a varying batch dimension by default; without it where that fails."""
    if dynamic_shapes is not None or not dynamic_batch:
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)
    try:
        dims = batch_dims_by_name(model, args, kwargs)
        return torch.export.export(model, args, kwargs, dynamic_shapes=dims)
    except QuantreeError:
        raise
    except Exception:  # the model's code does not allow it: capture the example's shapes
        return torch.export.export(model, args, kwargs)


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


def export_batch_dynamic(
    module: torch.nn.Module, example_args: tuple[Any, ...], dynamic_batch: bool = True
) -> torch.export.ExportedProgram:
    """Re-export a quantized module for saving: its first dimensions vary where the module
    allows it (it was captured with them varying), else they are fixed to the example's."""
    if dynamic_batch:
        try:
            return torch.export.export(
                module, example_args, dynamic_shapes=batch_dims(example_args, {}), strict=False
            )
        except Exception:  # guards or kernels pin the shapes: save them as they are
            pass
    return torch.export.export(module, example_args, strict=False)
