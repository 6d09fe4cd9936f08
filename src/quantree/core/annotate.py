"""annotate: ask the quantizer about every node once, and run the decompositions it asks for.

A rule may return an annotation that carries a ``decompose`` hook (cells mode does, for
recurrent layers): the hook rewrites the graph, and only the nodes it added are then
asked about. Graphs nested in modules (a cell loop's body) are annotated by their own call.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeWarning
from quantree.core.quantizer import Annotation, Quantizer
from quantree.core.values import is_float_tensor, is_getitem, leaves_with_paths, tensor_meta

_aten = torch.ops.aten
# Ops that only move, create or copy data: leaving them in float loses nothing worth a warning.
LAYOUT_OPS = frozenset(
    (
        _aten.view,
        _aten.reshape,
        _aten._unsafe_view,
        _aten.permute,
        _aten.transpose,
        _aten.t,
        _aten.unsqueeze,
        _aten.squeeze,
        _aten.flatten,
        _aten.unflatten,
        _aten.expand,
        _aten.expand_as,
        _aten.contiguous,
        _aten.clone,
        _aten.slice,
        _aten.select,
        _aten.zeros,
        _aten.ones,
        _aten.full,
        _aten.zeros_like,
        _aten.ones_like,
        _aten.new_zeros,
        _aten.new_ones,
        _aten.dropout,
        _aten.dropout_,
        _aten.detach,
        _aten.detach_,
        _aten.alias,
        _aten._to_copy,
        _aten.to,
        _aten.type_as,
        _aten.lift_fresh_copy,
        _aten.empty,
        _aten.arange,
        _aten.sym_size,
        _aten.copy,
        _aten.copy_,
    )
)


def annotate(gm: fx.GraphModule, quantizer: Quantizer) -> dict[fx.Node, Annotation]:
    """The annotation of every node some rule claims, after running decomposition hooks.

    ``gm`` is rewritten in place by the hooks (prepare passes its private copy).
    """
    annotations: dict[fx.Node, Annotation] = {}
    seen = set(gm.graph.nodes)
    decomposed = False
    for node in list(gm.graph.nodes):
        annotation = quantizer.annotate_node(node)
        if annotation is None:
            continue
        if annotation.decompose is not None:
            annotation.decompose(gm, node)
            decomposed = True
        else:
            annotations[node] = annotation
    if decomposed:
        for node in gm.graph.nodes:
            if node not in seen:
                annotation = quantizer.annotate_node(node)
                if annotation is not None:
                    annotations[node] = annotation
    return annotations


def warn_float_ops(
    gm: fx.GraphModule, annotations: dict[fx.Node, Annotation], stacklevel: int = 4
) -> None:
    """Name, in one warning, the compute ops no rule claimed (data movement excepted);
    ``stacklevel`` as ``warnings.warn`` counts it from here."""
    left = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node) or node in annotations:
            continue
        if getattr(node.target, "overloadpacket", None) in LAYOUT_OPS:
            continue
        if any(is_float_tensor(leaf) for _, leaf in leaves_with_paths(tensor_meta(node))):
            left.append(f"{node.target} at {node.name}")
    if left:
        warnings.warn(
            f"quantree left {len(left)} op(s) in float because no rule of the quantizer "
            f"matches them: {', '.join(left)}. Add a Rule for them to quantize them.",
            QuantreeWarning,
            stacklevel=stacklevel,
        )
