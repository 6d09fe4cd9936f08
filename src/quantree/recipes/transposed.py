"""The annotation of a transposed convolution: its weight keeps output channels on axis 1.

A transposed convolution's weight is ``[C_in, C_out / groups, *kernel]``, so a per-channel
weight grid is along axis 1, and with groups each of those ``C_out / groups`` scales serves
one output channel of every group (output channel ``g * C_out / groups + j`` reads scale
``j``). The int32 bias has one entry per output channel, so its derived scale is the input
scale times the weight's scales repeated once per group. ``aten.convolution`` with
``transposed=True`` (what a decomposed graph holds) is the same layer with other argument
positions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from quantree.core.quantizer import Annotation
from quantree.core.specs import DerivedSpec, QDtype, QParams, QuantSpec, product_of_scales
from quantree.core.values import Use, is_float_tensor, tensor_meta

aten = torch.ops.aten

TRANSPOSED_CONVS = (aten.conv_transpose1d, aten.conv_transpose2d)
"""The transposed convolutions as export writes them (``groups`` is argument 6)."""


def is_transposed_convolution(node: fx.Node) -> bool:
    """``aten.convolution(..., transposed=True, ...)`` (argument 6)."""
    if getattr(node.target, "overloadpacket", None) is not aten.convolution:
        return False
    return len(node.args) > 6 and node.args[6] is True


def transposed_groups(node: fx.Node) -> int:
    """The ``groups`` argument of a transposed conv call (1 when left at its default)."""
    position = 8 if getattr(node.target, "overloadpacket", None) is aten.convolution else 6
    groups = node.args[position] if len(node.args) > position else node.kwargs.get("groups", 1)
    return groups if isinstance(groups, int) else 1


def repeated_product_of_scales(groups: int, params: Sequence[QParams]) -> QParams:
    """``product_of_scales``, its per-channel scales repeated ``groups`` times (see above)."""
    p = product_of_scales(params)
    if not p.per_channel or groups == 1:
        return p
    return dataclasses.replace(
        p,
        scale=p.scale.reshape(-1).repeat(groups),
        zero_point=p.zero_point.reshape(-1).repeat(groups),
    )


def transposed_annotation(
    node: fx.Node, act: QuantSpec, weight: QuantSpec, output: Any, name: str | None = None
) -> Annotation:
    """Input ``act``, the weight (args[1]) per channel along axis 1 where ``weight`` is per
    channel, and an int32 bias (args[2]) derived from both, one scale per output channel."""
    wgt = dataclasses.replace(weight, axis=1) if weight.axis is not None else weight
    inputs: dict[tuple[int | str, ...], object] = {(0,): act, (1,): wgt}
    bias = node.args[2] if len(node.args) > 2 else None
    if isinstance(bias, fx.Node) and is_float_tensor(tensor_meta(bias)):
        derive = functools.partial(repeated_product_of_scales, transposed_groups(node))
        sources = (Use.of(node, (0,)), Use.of(node, (1,)))
        inputs[(2,)] = DerivedSpec(sources, derive, QDtype.INT32)
    return Annotation(outputs=output, inputs=inputs, name=name)
