"""The annotation of a layer with weights (linear, conv): the one place that knows its inputs.

Shared by the default recipe and by cells-mode points, so that giving a projection's output a
spec of one's own never leaves its weight or bias in float.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from quantree.core.quantizer import Annotation
from quantree.core.specs import QuantSpec, bias_spec
from quantree.core.values import Use, is_float_tensor, tensor_meta


def weighted_annotation(
    node: fx.Node, act: QuantSpec, weight: QuantSpec, output: Any, name: str | None = None
) -> Annotation:
    """Input ``act``, weight ``weight`` (args[1]), an int32 bias derived from both (args[2])."""
    inputs: dict[tuple[int | str, ...], object] = {(0,): act, (1,): weight}
    bias = node.args[2] if len(node.args) > 2 else None
    if isinstance(bias, fx.Node) and is_float_tensor(tensor_meta(bias)):
        inputs[(2,)] = bias_spec(Use.of(node, (0,)), Use.of(node, (1,)))
    return Annotation(outputs=output, inputs=inputs, name=name)
