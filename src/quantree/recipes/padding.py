"""``pad`` keeps its input's grid: reflect, replicate and circular copy values, a zero fill
adds zeros, which every affine grid holds exactly. A fill of another constant is left to
the float model (it may lie outside the input's range)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.core.quantizer import Annotation, Rule
from quantree.core.specs import QuantSpec, SharedSpec
from quantree.core.values import Use

aten = torch.ops.aten

COPYING_MODES = ("reflect", "replicate", "circular")
PAD_OPS = (aten.pad, aten.constant_pad_nd)


def pad_fill(node: fx.Node) -> float | None:
    """The constant a ``pad``/``constant_pad_nd`` writes (None: it copies values)."""
    a: list[Any] = [*node.args, None, None, None][:4]
    if getattr(node.target, "overloadpacket", None) is aten.constant_pad_nd:
        return float(a[2] or 0.0)
    mode: Any = node.kwargs.get("mode", a[2] or "constant")
    value: Any = node.kwargs.get("value", a[3])
    return None if mode in COPYING_MODES else float(value or 0.0)


def pad_rule(act: QuantSpec) -> Rule:
    """Input on ``act``, output on the input's grid."""

    def annotate(node: fx.Node) -> Annotation | None:
        if pad_fill(node) not in (None, 0.0):
            return None
        return Annotation(outputs=SharedSpec(Use.of(node, (0,))), inputs={(0,): act})

    return Rule(PAD_OPS, annotate)
