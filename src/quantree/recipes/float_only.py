"""A recipe quantizes float tensors only: integer side chains are never annotated.

Models compute indices next to their float data (``torch.arange(n).unbind()``, ``tolist()``
loops, index math for ``index_select``) with the same ops the recipes claim for float
tensors (``unbind``, ``split``, ``cat``, ``add``). Each recipe rule states what it quantizes
for a float op; ``on_floats`` drops, from whatever a rule returns, every spec on an input or
output that is not a float tensor, and the whole annotation when nothing float is left, so
the integer chain stays as the model wrote it. A user's own rules are not wrapped: a spec a
user puts on an integer tensor is still refused with the node named.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from quantree.core.quantizer import AnnotateFn, Annotation, Rule
from quantree.core.values import Use, is_float_tensor, tensor_meta


def on_floats(rule: Rule) -> Rule:
    """``rule`` with its annotations restricted to float tensors."""
    return replace(rule, annotate=_restricted(rule.annotate))


def _restricted(annotate: AnnotateFn) -> AnnotateFn:
    def restricted(node: fx.Node) -> Annotation | None:
        annotation = annotate(node)
        if annotation is None or annotation.decompose is not None:
            return annotation
        index = index_math(node.graph)
        inputs = {
            path: spec
            for path, spec in annotation.inputs.items()
            if spec is None or _float_data(Use.of(node, tuple(path)), index)
        }
        leaves = tensor_meta(node)
        outputs = annotation.outputs
        if outputs is not None and (not _has_float_leaf(leaves) or node in index):
            outputs = None
        if not inputs and outputs is None and (annotation.inputs or annotation.outputs):
            return None  # all of it was integer: the op is not the recipe's to claim
        return replace(annotation, inputs=inputs, outputs=outputs)

    return restricted


def _float_data(use: Use, index: set[fx.Node]) -> bool:
    """``use`` reads a float tensor that is not index math."""
    return is_float_tensor(use.value.meta) and use.value.node not in index


_INDEX_ATTR = "_quantree_index_math"
"""Attribute on the graph being annotated (prepare's own copy): its index math with the node
count then, so a graph decomposition grew is redone. Kept on the graph, not in a module-level
table, so that nothing outlives or is shared between the graphs quantree works on."""


def index_math(graph: fx.Graph) -> set[fx.Node]:
    """Float-valued nodes of ``graph`` every tensor input of which is an integer tensor or
    index math itself (and at least one is an integer tensor or index math)."""
    count = len(graph.nodes)
    known = getattr(graph, _INDEX_ATTR, None)
    if known is not None and known[0] == count:
        return known[1]
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not _has_float_leaf(tensor_meta(node)):
            continue
        tensors = [n for n in node.all_input_nodes if _is_tensor(n)]
        if tensors and all(n in found or _integer_tensor(n) for n in tensors):
            found.add(node)
    setattr(graph, _INDEX_ATTR, (count, found))
    return found


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(tensor_meta(node), torch.Tensor)


def _integer_tensor(node: fx.Node) -> bool:
    """An integer or boolean tensor; a complex one is data (an STFT's spectrum, which
    ``view_as_real`` turns into the float a spectrogram model's convolutions read: HDemucs
    failed to prepare when it counted as index math)."""
    meta = tensor_meta(node)
    return isinstance(meta, torch.Tensor) and not (meta.is_floating_point() or meta.is_complex())


def _has_float_leaf(tree: object) -> bool:
    found = []
    tree_map(lambda leaf: found.append(is_float_tensor(leaf)), tree)
    return any(found)
