"""Lowering rules for ``linear`` and ``conv2d`` (each optionally followed by ``relu``).

Pattern: ``dq(x int8) -> linear/conv(dq(W int8), dq(b int32)) [-> relu] -> q``. The
replacement reads the int8 ``x`` directly and writes the int8 result, so a chain of lowered
layers never leaves int8. Integer biases whose scale is exactly input x weight scale are
added to the int32 accumulator (the kernel is then exact); others are added in float.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backend import LoweringContext
from quantree.backends import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.packing import pack, zero_point_offset
from quantree.backends.patterns import (
    Activation,
    Output,
    Weight,
    activation,
    constant,
    float_constant,
    output,
    replace,
    weight,
)
from quantree.graphs import fetch_attr

aten = torch.ops.aten
quantree_ops = torch.ops.quantree


def _accumulator_terms(
    ctx: LoweringContext, x: Activation, w: Weight, bias_arg: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(int32 offset, float32 scale, float bias or None) of ``y = (acc + offset) * scale``."""
    n = w.values.shape[0]
    scale = (x.scale * w.scale).float()
    offset = zero_point_offset(w.values, x.zero_point)
    dq = ctx.dequantized(bias_arg) if bias_arg is not None else None
    if dq is not None and dq.is_constant and dq.params.dtype.torch_dtype == torch.int32:
        bias_scale = dq.params.scale.float().reshape(-1).expand(n)
        if torch.equal(bias_scale, scale) and bool((dq.params.zero_point == 0).all()):
            stored = fetch_attr(ctx.gm, str(dq.source.target)).reshape(n).to(torch.int32)
            return offset + stored, scale, None
    bias = float_constant(ctx, bias_arg, n)
    if bias is None:
        return None
    return offset, scale, bias if bias_arg is not None else None


def _chain(node: fx.Node, out: Output) -> list[fx.Node]:
    chain = [out.replaces]
    if out.relu:
        chain.append(next(iter(node.users)))
    if out.replaces is not node:
        chain.append(node)
    return chain


def lower_linear(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target != aten.linear.default:
        return False
    x, w = activation(ctx, node.args[0]), weight(ctx, node.args[1])
    out = output(ctx, node)
    if x is None or w is None or out is None or w.values.dim() != 2:
        return False
    terms = _accumulator_terms(ctx, x, w, node.args[2] if len(node.args) > 2 else None)
    if terms is None:
        return False
    offset, scale, bias = terms
    args = [
        constant(ctx, "_cpu_weight_", pack(w.values), node),
        constant(ctx, "_cpu_offset_", offset, node),
        constant(ctx, "_cpu_scale_", scale, node),
        None if bias is None else constant(ctx, "_cpu_bias_", bias, node),
    ]
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            quantree_ops.linear.default,
            (x.node, *args, w.values.shape[0], out.scale, out.zero_point, out.relu),
        )
    replace(ctx, out.replaces, new, _chain(node, out))
    return True


def _pair(v: object, default: int) -> list[int]:
    if v is None:
        return [default, default]
    items: list[Any] = list(v) if isinstance(v, list | tuple) else [v]
    return [int(i) for i in (items * 2 if len(items) == 1 else items)]


def lower_conv2d(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target != aten.conv2d.default:
        return False
    a = list(node.args) + [None] * (7 - len(node.args))
    x, w = activation(ctx, a[0]), weight(ctx, a[1])
    out = output(ctx, node)
    groups = 1 if a[6] is None else a[6]
    if x is None or w is None or out is None or groups != 1 or w.values.dim() != 4:
        return False
    terms = _accumulator_terms(ctx, x, w, a[2])
    if terms is None:
        return False
    offset, scale, bias = terms
    args = [  # the kernel reads (kh, kw, c) rows of channels-last im2col
        constant(ctx, "_cpu_weight_", pack(w.values.permute(0, 2, 3, 1)), node),
        constant(ctx, "_cpu_offset_", offset, node),
        constant(ctx, "_cpu_scale_", scale, node),
        None if bias is None else constant(ctx, "_cpu_bias_", bias, node),
    ]
    geometry = (
        w.values.shape[0],
        [int(w.values.shape[2]), int(w.values.shape[3])],
        _pair(a[3], 1),
        _pair(a[4], 0),
        _pair(a[5], 1),
        x.zero_point,
    )
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            quantree_ops.conv2d.default,
            (x.node, *args, *geometry, out.scale, out.zero_point, out.relu),
        )
    replace(ctx, out.replaces, new, _chain(node, out))
    return True
