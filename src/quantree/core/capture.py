"""capture: a model becomes an ATen-level ``GraphModule`` through ``torch.export``.

``export_graph`` is the core of the one public ``quantree.capture`` (``recurrent/capture.py``),
which adds the recurrent wing's packed sequences around it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_map

from quantree.core.capturing.data_dependent import export_on_example_values
from quantree.core.capturing.fake_cache import fake_tensor_cache_off
from quantree.core.capturing.float64 import refuse_float64
from quantree.core.capturing.frozen import parameters_without_grad
from quantree.core.capturing.input_trees import batch_spec, register_dataclasses
from quantree.core.capturing.keyword_inputs import named_keywords, respelled_shapes
from quantree.core.capturing.shape_guards import explain_shape_guards
from quantree.core.capturing.train_mode import warn_train_mode
from quantree.core.errors import QuantreeError, QuantreeWarning


def export_graph(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
    every_dim: bool = False,
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
    fixes every dimension to the example's. ``every_dim`` leaves every dimension to vary where
    the model allows it (a sequence length, an image size), falling back to the batch alone
    where export refuses that.
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
    refuse_float64(model)
    was_training = model.training
    if not isinstance(model, fx.GraphModule):  # a saved program's module has no train mode
        warn_train_mode(model, stacklevel=4)
    _set_training(model, False)
    try:
        with warnings.catch_warnings(), fake_tensor_cache_off():
            # nn.RNNBase keeps a list of its weights that export reports as reassigned.
            warnings.filterwarnings("ignore", message=".*_flat_weights.*")
            register_dataclasses(example_args, dict(example_kwargs or {}))
            example_args, kwargs = unaliased(example_args, dict(example_kwargs or {}))
            try:
                with parameters_without_grad(model):
                    program = _export(
                        model, example_args, kwargs, dynamic_shapes, dynamic_batch, every_dim
                    )
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
    _refuse_autocast(model, program)
    module = program.module()
    for node in module.graph.nodes:  # before the guards' explainer reads the input shapes
        if "val" in node.meta:
            node.meta["val"] = tree_map(concrete_sizes, node.meta["val"])
    return explain_shape_guards(module)


def concrete_sizes(val: Any) -> Any:
    """``val`` with each size export left symbolic but pinned to one value (a dimension
    marked ``Dim.AUTO`` that the model fixes) as a plain int, as if it had never varied: the
    passes after capture tell fixed sizes from varying ones by ``isinstance(size, int)``."""
    if isinstance(val, torch.SymInt):
        pinned = val.node.maybe_as_int()
        return val if pinned is None else pinned
    if not isinstance(val, torch.Tensor) or not hasattr(val, "fake_mode"):
        return val
    if all(isinstance(d, int) for d in (*val.shape, *val.stride())):
        return val
    size = [concrete_sizes(d) for d in val.shape]
    stride = [concrete_sizes(d) for d in val.stride()]
    if _as_made_new(val) and all(
        a is b for a, b in zip((*size, *stride), (*val.shape, *val.stride()), strict=True)
    ):
        return val  # nothing pinned: the tensor made below would be this one again
    with val.fake_mode:
        return torch.empty_strided(size, stride, dtype=val.dtype, device=val.device)


def _as_made_new(val: torch.Tensor) -> bool:
    """Whether ``torch.empty_strided`` of ``val``'s sizes and strides makes a tensor like
    ``val`` (not a view, at offset 0, no grad, no conjugate or negative bit); making one
    with symbolic sizes costs about as much as tracing an op, once per node."""
    offset = val.storage_offset()
    return (
        val._base is None
        and isinstance(offset, int)
        and offset == 0
        and not val.requires_grad
        and not val.is_conj()
        and not val.is_neg()
        and val.layout == torch.strided
    )


def _refuse_autocast(model: torch.nn.Module, program: torch.export.ExportedProgram) -> None:
    """An autocast region inside ``forward`` is a QuantreeError naming it.

    torch.export keeps it as a ``wrap_with_autocast`` submodule followed by checks that its
    outputs are in the autocast dtype; quantizing the ops inside makes them float32, and
    the quantized model then failed with torch's "Tensor dtype mismatch" on every call.
    """
    wrapped = [
        str(n.name)
        for n in program.graph.nodes
        if n.op == "call_function"
        and "wrap_with_autocast" in str(n.target)
        and len(n.args) > 2
        and n.args[2] is True  # (device, dtype, enabled, ...): a disabled region is float
    ]
    if wrapped:
        raise QuantreeError(
            f"{type(model).__name__} runs torch.autocast inside forward (captured as "
            f"{', '.join(wrapped)}): quantree cannot quantize ops inside an autocast region "
            "(their quantized form computes in float32, not the autocast dtype). Remove the "
            "autocast from forward for quantization: the quantized ops set the precision"
        )


def unaliased(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The example inputs with each tensor that shares storage with an earlier one cloned.

    torch.export (2.13) traces inputs that alias as one: ``model(x, x)`` is captured as a
    graph that reads its last such input for all of them, which computes wrong (silently)
    once the inputs differ. A view (a slice of a longer batch) is copied too: export guards
    on the example's ``_base`` (``t._base.size()[1] != 8``), a check every later call with a
    plain tensor failed with a raw ``AttributeError``. The copies hold the same values (and
    the strides of a dense view: a channels-last example stays channels-last); the user's
    tensors are not touched.
    """
    seen: set[tuple[torch.device, int]] = set()

    def distinct(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        key = (x.device, x.untyped_storage().data_ptr())
        if (key in seen and x.numel()) or x._base is not None:
            return x.clone()
        seen.add(key)
        return x

    return tree_map(distinct, args), tree_map(distinct, kwargs)


def batch_dims(
    example_args: tuple[Any, ...], example_kwargs: dict[str, Any], every_dim: bool = False
) -> Any:
    """``dynamic_shapes`` marking dim 0 (or every dim) of every tensor input ``Dim.AUTO``,
    shaped like the inputs (None for what is not a tensor), positional then keyword values."""
    return (
        *(batch_spec(a, every_dim) for a in example_args),
        *(batch_spec(v, every_dim) for v in example_kwargs.values()),
    )


def batch_dims_by_name(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], every_dim: bool = False
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
        return batch_dims(args, kwargs, every_dim)
    return {name: batch_spec(value, every_dim) for name, value in bound.arguments.items()}


def _export(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
    dynamic_batch: bool,
    every_dim: bool = False,
) -> torch.export.ExportedProgram:
    """Export, with a varying batch dimension by default; at the example's shapes, with one
    ``QuantreeWarning`` saying so and why, where the batch cannot vary."""
    view = named_keywords(model, kwargs)
    if dynamic_shapes is not None:
        shapes = respelled_shapes(model, view, dynamic_shapes)
        return torch.export.export(view, args, kwargs, dynamic_shapes=shapes)
    if not dynamic_batch:
        return torch.export.export(model, args, kwargs)
    if every_dim:
        try:
            return torch.export.export(
                view, args, kwargs, dynamic_shapes=batch_dims_by_name(view, args, kwargs, True)
            )
        except (QuantreeError, GuardOnDataDependentSymNode):
            raise
        except Exception:  # the model's code refuses some varying dimension: the batch alone
            pass
    try:
        program = torch.export.export(
            view, args, kwargs, dynamic_shapes=batch_dims_by_name(view, args, kwargs)
        )
    except QuantreeError:
        raise
    except GuardOnDataDependentSymNode:
        raise
    except Exception as error:  # the model's code does not allow it: the example's shapes
        program = torch.export.export(model, args, kwargs)
        warn_fixed_batch(
            model, program, f"torch.export refused a varying batch: {_first_line(error)}"
        )
        return program
    fixed = fixed_batch_inputs(program)
    if fixed is not None:
        warn_fixed_batch(model, program, fixed)
    return program


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _user_inputs(program: torch.export.ExportedProgram) -> list[tuple[str, Any]]:
    """The placeholders of the user's inputs (not parameters, buffers or constants) and
    their example values."""
    from torch.export.graph_signature import InputKind

    users = {
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind is InputKind.USER_INPUT
    }
    return [
        (str(n.name), n.meta.get("val"))
        for n in program.graph.nodes
        if n.op == "placeholder" and n.name in users
    ]


def fixed_batch_inputs(program: torch.export.ExportedProgram) -> str | None:
    """Why no input's batch varies, when a varying one was asked for and none does; None
    when one varies (or there is no tensor input with a batch dimension).

    ``Dim.AUTO`` leaves a dimension static where the example's size is 0 or 1 (torch
    specializes those) or where the model's code fixes it (a ``view(2, -1)``, a parameter
    of that size): export does not say which, and the graph then refuses every other batch.
    """
    batched = [
        (name, val)
        for name, val in _user_inputs(program)
        if isinstance(val, torch.Tensor) and val.dim() > 0
    ]
    if not batched or any(not isinstance(val.shape[0], int) for _, val in batched):
        return None
    small = sorted({int(val.shape[0]) for _, val in batched if int(val.shape[0]) in (0, 1)})
    if small:
        return (
            f"the example's batch size is {small[0]}, which torch.export always fixes; give "
            "an example with a batch of 2 or more"
        )
    return (
        "the model's code fixes the first dimension of every input (e.g. a reshape to the "
        "example's batch size, or a parameter of that size); write it with -1 or x.shape[0]"
    )


def warn_fixed_batch(
    model: torch.nn.Module, program: torch.export.ExportedProgram, why: str
) -> None:
    """One ``QuantreeWarning``: the model was captured at fixed shapes, why, and the fix."""
    shapes = (
        ", ".join(
            f"{name} {tuple(val.shape)}"
            for name, val in _user_inputs(program)[:6]
            if isinstance(val, torch.Tensor)
        )
        or "no tensor inputs"
    )
    warnings.warn(
        f"{type(model).__name__} was captured at the example's fixed shapes ({shapes}): its "
        f"batch dimension cannot vary because {why}. A call with another "
        "batch size raises a QuantreeError; give dynamic_shapes= (as for torch.export) to say "
        "which dimensions vary, or dynamic_batch=False to fix them without this warning",
        QuantreeWarning,
        stacklevel=5,
    )


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
    """Re-export a quantized module for saving: its dimensions vary where the module allows
    it (it was captured with them varying: every dimension, else the first), else they are
    fixed to the example's."""
    with fake_tensor_cache_off():
        if dynamic_batch:
            for every_dim in (True, False) if _varies_beyond_batch(module) else (False,):
                try:
                    shapes = batch_dims(example_args, {}, every_dim)
                    return torch.export.export(
                        module, example_args, dynamic_shapes=shapes, strict=False
                    )
                except Exception:  # guards or kernels pin the shapes: fewer vary
                    pass
        return torch.export.export(module, example_args, strict=False)


def _varies_beyond_batch(module: torch.nn.Module) -> bool:
    """Whether a captured graph takes an input with a symbolic dimension after the first
    (a sequence length): only then is every dimension left to vary when re-exporting, so a
    model captured at fixed sizes is saved at them."""
    if not isinstance(module, fx.GraphModule):
        return False
    for node in module.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape[1:]):
            return True
    return False
