"""Which input dimensions vary in the ONNX export: the ones that vary in the reference graph.

A reference graph is captured either with a dimension left symbolic (``dynamic_shapes`` at
capture) or fixed at the example's size. What was fixed is baked into the graph's values: a
recurrent layer's zero initial state, a reshape, a constant folded from the input's size.
Exporting with that dimension made dynamic again gives an ONNX model that accepts other sizes
at its input and then fails inside (ONNX Runtime's ``initial_h must have shape {1,3,5}``), or
computes with the example's size. So the export follows the graph: by default every dimension
symbolic in the graph is dynamic in ONNX (the batch varies in ONNX as it does in torch), and a
``dynamic_shapes`` that frees a dimension the graph fixed is refused, naming the input, the
dimension and the fix (capture with that dimension dynamic).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import BUILTIN_TYPES, SUPPORTED_NODES, _get_node_type, tree_flatten

from quantree.core.errors import QuantreeError


def _symbolic_dims(value: object) -> list[int] | None:
    if not isinstance(value, torch.Tensor):
        return None
    return [d for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt)]


def _input_values(ref: fx.GraphModule) -> list[object]:
    return [n.meta.get("val") for n in ref.graph.nodes if n.op == "placeholder"]


def _mirror(tree: Any, leaves: Iterator[Any]) -> Any:
    """``tree`` with each leaf replaced by the next of ``leaves`` (pytree's flatten order);
    registered user types become the list of their children, as torch.export matches them."""
    kind = _get_node_type(tree)
    if isinstance(tree, torch.Tensor) or kind not in SUPPORTED_NODES:
        return next(leaves)
    children, context = SUPPORTED_NODES[kind].flatten_fn(tree)
    specs = [_mirror(child, leaves) for child in children]
    if kind in BUILTIN_TYPES:
        return SUPPORTED_NODES[kind].unflatten_fn(specs, context)
    return specs


def captured_dynamic_shapes(
    ref: fx.GraphModule, example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any]
) -> Any:
    """``dynamic_shapes`` freeing exactly the dimensions symbolic in ``ref``'s inputs, or None
    when every dimension is fixed (or the inputs cannot be matched to the graph's)."""
    values = _input_values(ref)
    leaves = tree_flatten((example_args, dict(example_kwargs)))[0]
    if len(leaves) != len(values):
        return None
    specs = []
    for leaf, value in zip(leaves, values, strict=True):
        dims = _symbolic_dims(value) if isinstance(leaf, torch.Tensor) else None
        specs.append({d: torch.export.Dim.AUTO for d in dims} if dims else None)
    if not any(specs):
        return None
    flat = iter(specs)
    positional = [_mirror(a, flat) for a in example_args]
    if not example_kwargs:
        return tuple(positional)
    names = list(inspect.signature(ref.forward).parameters)[: len(example_args)]
    shapes = dict(zip(names, positional, strict=True))
    shapes.update({k: _mirror(v, flat) for k, v in example_kwargs.items()})
    return shapes


def check_exported_dims(ref: fx.GraphModule, program: torch.export.ExportedProgram) -> None:
    """Refuse an export whose inputs vary where the reference graph's are fixed."""
    user = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    exported = [n.meta.get("val") for n in program.graph.nodes if n.name in user]
    captured = _input_values(ref)
    if len(exported) != len(captured):
        return
    names = [n.name for n in ref.graph.nodes if n.op == "placeholder"]
    for name, got, had in zip(names, exported, captured, strict=True):
        free, fixed = _symbolic_dims(got), _symbolic_dims(had)
        if free is None or fixed is None or not isinstance(had, torch.Tensor):
            continue
        for d in free:
            if d not in fixed:
                raise QuantreeError(
                    f"input {name!r} dimension {d} is dynamic in the ONNX export but was fixed "
                    f"at {int(had.shape[d])} when the reference graph was captured; the graph "
                    "holds values of that size (a recurrent layer's initial state, a reshape) "
                    "that would not follow it in ONNX. Capture it dynamic: qt.quantize(model, "
                    f"example_args, data, dynamic_shapes=... with {{{d}: torch.export.Dim.AUTO}} "
                    f"for {name!r}), then export without dynamic_shapes (the export follows "
                    "the graph)"
                )


def pin_numeric_dims(model: Any) -> None:
    """Make every input and output dimension named by a number (the exporter writes a size
    a recurrent layer pinned as ``dim_param: "6"``, which ONNX Runtime reads as free) that
    fixed size, so ONNX refuses the sizes torch refuses."""
    from onnxscript import ir

    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.shape is None:
            continue
        dims = [
            int(str(d.value)) if isinstance(d, ir.SymbolicDim) and str(d.value).isdigit() else d
            for d in value.shape
        ]
        value.shape = ir.Shape(dims)
