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
        inputs = {
            path: spec
            for path, spec in annotation.inputs.items()
            if spec is None or is_float_tensor(Use.of(node, tuple(path)).value.meta)
        }
        leaves = tensor_meta(node)
        outputs = annotation.outputs
        if outputs is not None and not _has_float_leaf(leaves):
            outputs = None
        if not inputs and outputs is None and (annotation.inputs or annotation.outputs):
            return None  # all of it was integer: the op is not the recipe's to claim
        return replace(annotation, inputs=inputs, outputs=outputs)

    return restricted


def _has_float_leaf(tree: object) -> bool:
    found = []
    tree_map(lambda leaf: found.append(is_float_tensor(leaf)), tree)
    return any(found)
