"""Lowering rule for ``conv_transpose1d``/``conv_transpose2d`` (optionally followed by ``relu``).

Pattern: ``dq(x int8) -> conv_transpose(dq(W int8, per channel on axis 1 or per tensor),
dq(b int32)) [-> relu] [-> q]``, also as ``aten.convolution(transposed=True)``. The
replacement is ``quantree.conv_transpose`` (``ops/conv_transpose.py``), whose int32
accumulation is exact; an int32 bias on exactly the accumulator's scale is added to it,
another bias in float, as for conv (``rules.linear.accumulator_terms``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.ops.conv_transpose import CHUNK, packed_transposed_weight
from quantree.backends.cpu.ops.wide import LO_ZERO_POINT
from quantree.backends.cpu.rules.linear import int_list, replaced_chain
from quantree.backends.cpu.rules.wide import WideInput, wide_input
from quantree.backends.patterns import activation, constant, float_constant, output, replace
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext
from quantree.core.specs import QDtype

aten = torch.ops.aten
quantree_ops = torch.ops.quantree

EXACT_TERMS = 1 << 31
"""The int32 accumulator holds at most ``input channels a group x taps x 255 x 127``: a
layer that could exceed it stays in the reference form."""


def _arguments(node: fx.Node) -> tuple[int, list[Any]] | None:
    """(spatial dims, [x, w, bias, stride, padding, output_padding, groups, dilation])."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet in (aten.conv_transpose1d, aten.conv_transpose2d):
        dims = 1 if packet is aten.conv_transpose1d else 2
        a = list(node.args) + [None] * (8 - len(node.args))
        return dims, a
    if packet is aten.convolution and len(node.args) >= 9 and node.args[6] is True:
        x, w, b, stride, padding, dilation, _, output_padding, groups = node.args[:9]
        rank = len(stride) if isinstance(stride, list | tuple) else 0
        if rank not in (1, 2):
            return None
        return rank, [x, w, b, stride, padding, output_padding, groups, dilation]
    return None


def _weight(
    ctx: LoweringContext, arg: object, groups: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 ``[C, O / groups, *k]``, float32 scale per output channel) of a weight on a
    symmetric int8 grid per tensor or per channel along axis 1."""
    dq = ctx.dequantized(arg)
    if dq is None or not dq.is_constant or dq.params.dtype != QDtype.INT8:
        return None
    p = dq.params
    if bool((p.zero_point != 0).any()) or p.axis not in (None, 1):
        return None
    values = fetch_attr(ctx.gm, str(dq.source.target))
    per_group = int(values.shape[1])
    scale = p.scale.float().reshape(-1).expand(per_group) if p.axis is None else p.scale.float()
    return values, scale.reshape(-1).repeat(groups).contiguous()


def lower_conv_transpose(ctx: LoweringContext, node: fx.Node) -> bool:
    """conv_transpose1d / conv_transpose2d (+relu): stride, padding, output_padding,
    dilation, groups; an int8 or float result. An int16 input (``WEIGHTED_INPUTS``' 1-d
    layers) runs as ``quantree.conv_transpose16``, float out."""
    parsed = _arguments(node)
    if parsed is None:
        return False
    dims, a = parsed
    groups = 1 if a[6] is None else a[6]
    if not isinstance(groups, int) or groups < 1:
        return False
    w = _weight(ctx, a[1], groups)
    if w is None or w[0].dim() != dims + 2:
        return False
    values, w_scale = w
    in_channels, per_group = int(values.shape[0]), int(values.shape[1])
    terms = (in_channels // groups) * values[0, 0].numel() * 255 * 127
    if in_channels % groups or terms >= EXACT_TERMS:
        return False
    out_channels = per_group * groups
    geometry = (
        out_channels,
        [int(k) for k in values.shape[2:]],
        int_list(a[3], dims, 1),
        int_list(a[4], dims, 0),
        int_list(a[5], dims, 0),
        int_list(a[7], dims, 1),
        groups,
    )
    wide = wide_input(ctx, a[0])
    if wide is not None:
        return _lower_wide(ctx, node, a[2], values, w_scale, wide, geometry)
    x, out = activation(ctx, a[0]), output(ctx, node)
    if x is None or out is None:
        return False
    scale = (x.scale * w_scale).float()
    bias_terms = _bias(ctx, a[2], scale, out_channels)
    if bias_terms is None:
        return False
    offset, bias = bias_terms
    packed, col_offset = packed_transposed_weight(values, groups, x.zero_point)
    with ctx.gm.graph.inserting_before(node):
        args = [
            constant(ctx, "_cpu_weight_", packed, node),
            constant(ctx, "_cpu_col_offset_", col_offset, node),
            constant(ctx, "_cpu_offset_", offset, node),
            constant(ctx, "_cpu_scale_", scale, node),
            None if bias is None else constant(ctx, "_cpu_bias_", bias, node),
        ]
        new = ctx.gm.graph.call_function(
            quantree_ops.conv_transpose.default,
            (x.node, *args, *geometry, out.scale, out.zero_point, out.relu),
        )
    replace(ctx, out.replaces, new, replaced_chain(node, out))
    return True


def _lower_wide(
    ctx: LoweringContext,
    node: fx.Node,
    bias_arg: object,
    values: torch.Tensor,
    w_scale: torch.Tensor,
    wide: WideInput,
    geometry: tuple[Any, ...],
) -> bool:
    """The int16 input's planes: hi on zero point 0 and 256 x the scale, lo on zero point
    -128 and the scale, which is the int32 bias's grid (``ops/wide.py``)."""
    dq, x, x_scale, qmin, qmax = wide
    out_channels, groups = geometry[0], geometry[-1]
    scale = (x_scale * w_scale).float()
    bias_terms = _bias(ctx, bias_arg, scale, out_channels)
    if bias_terms is None:
        return False
    offset, bias = bias_terms
    packed, hi_col_offset = packed_transposed_weight(values, groups, 0)
    _, lo_col_offset = packed_transposed_weight(values, groups, LO_ZERO_POINT)
    with ctx.gm.graph.inserting_before(node):
        args = [
            constant(ctx, "_cpu_weight_", packed, node),
            constant(ctx, "_cpu_col_offset_", hi_col_offset, node),
            constant(ctx, "_cpu_col_offset_", lo_col_offset, node),
            constant(ctx, "_cpu_offset_", offset, node),
            constant(ctx, "_cpu_scale_", (x_scale * 256.0 * w_scale).float(), node),
            constant(ctx, "_cpu_scale_", scale, node),
            None if bias is None else constant(ctx, "_cpu_bias_", bias, node),
        ]
        new = ctx.gm.graph.call_function(
            quantree_ops.conv_transpose16.default, (x, x_scale, qmin, qmax, *args, *geometry)
        )
    replace(ctx, node, new, [node, dq, dq.args[0]])  # type: ignore[list-item]
    return True


def _bias(
    ctx: LoweringContext, arg: object, scale: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(int32 offset per output channel, float bias or None): an int32 bias on exactly the
    accumulator's scale goes into the offset, any other bias stays float."""
    dq = ctx.dequantized(arg) if arg is not None else None
    if dq is not None and dq.is_constant and dq.params.dtype.torch_dtype == torch.int32:
        bias_scale = dq.params.scale.float().reshape(-1).expand(n)
        if torch.equal(bias_scale, scale) and bool((dq.params.zero_point == 0).all()):
            stored = fetch_attr(ctx.gm, str(dq.source.target)).reshape(n).to(torch.int32)
            return stored.contiguous(), None
    if arg is None:
        return torch.zeros(n, dtype=torch.int32), None
    bias = float_constant(ctx, arg, n)
    if bias is None:
        return None
    return torch.zeros(n, dtype=torch.int32), bias


__all__ = ["CHUNK", "lower_conv_transpose"]
