"""Lowering rule for linear / conv1d / conv2d reading an int16 activation (w8a16).

Pattern: ``dq16(q16(x)) -> linear/conv(dq(W int8), dq(b int32))``, the input symmetric
int16 per tensor, the output float (what the recipe makes of what weights read in a
transformer, see ``quantree.recipes.activation_points``). The replacement reads the float ``x`` and
quantizes it inside the op (``ops/wide.py``: two int8 byte planes on the int8 kernels), so
no int16 tensor is materialised and the int32 bias lands exactly on the low plane's grid.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.ops.wide import LO_ZERO_POINT
from quantree.backends.cpu.rules.linear import (
    CONVOLUTIONS,
    accumulator_terms,
    conv_geometry,
    lowered_constants,
    pack,
    pack_conv_weight,
    replace_bias,
)
from quantree.backends.patterns import Activation, float_constant, replace, weight
from quantree.core.lower import LoweringContext
from quantree.core.qdq import QUANTIZE_PER_TENSOR
from quantree.core.specs import QDtype

aten = torch.ops.aten
quantree_ops = torch.ops.quantree


WideInput = tuple[fx.Node, fx.Node, float, int, int]


def wide_input(ctx: LoweringContext, arg: object) -> WideInput | None:
    """(dequantize, float input, scale, quant_min, quant_max) of a symmetric int16 input."""
    dq = ctx.dequantized(arg)
    if dq is None or dq.is_constant or dq.source.target != QUANTIZE_PER_TENSOR:
        return None
    p = dq.params
    if p.dtype != QDtype.INT16 or p.axis is not None or bool((p.zero_point != 0).any()):
        return None
    source = dq.source.args[0]
    if not isinstance(source, fx.Node):
        return None
    return dq.node, source, float(p.scale), p.quant_min, p.quant_max


def lower_wide(ctx: LoweringContext, node: fx.Node) -> bool:
    """linear / conv1d / conv2d with an int16 input and an int8 weight, float out."""
    dims = 0 if node.target == aten.linear.default else CONVOLUTIONS.get(node.target)  # type: ignore[call-overload]
    if dims is None:
        return False
    wide = wide_input(ctx, node.args[0])
    w = weight(ctx, node.args[1])
    if wide is None or w is None or w.values.dim() != dims + 2:
        return False
    dq, x, scale, qmin, qmax = wide
    args = list(node.args) + [None] * (7 - len(node.args))
    # the hi plane (zero point 0) on 256 x the input scale, the lo plane (zero point -128)
    # on the input scale, which is the int32 bias's grid
    call: tuple[Any, ...]
    if dims == 0:  # one dual pass: the hi plane's offset, the input scale, a float bias
        packed = pack(w.values)
        hi = accumulator_terms(ctx, Activation(x, scale * 256.0, 0), w, None, packed)
        lo = accumulator_terms(ctx, Activation(x, scale, LO_ZERO_POINT), w, args[2], packed)
        if hi is None or lo is None:
            return False
        n = int(w.values.shape[0])
        bias = float_constant(ctx, args[2], n)
        if bias is None:
            return False
        dual = replace_bias(hi, lo.scale, lo.scale_recipe, bias if args[2] is not None else None)
        consts = lowered_constants(ctx, node, packed, dual)
        target, call = quantree_ops.linear16.default, (*consts, n)
    else:
        geometry = conv_geometry(args, w.values, dims)
        if geometry is None:
            return False
        groups = geometry[-1]
        packed = pack_conv_weight(w.values, groups)
        hi = accumulator_terms(ctx, Activation(x, scale * 256.0, 0), w, None, packed, groups)
        lo = accumulator_terms(ctx, Activation(x, scale, LO_ZERO_POINT), w, args[2], packed, groups)
        if hi is None or lo is None:
            return False
        packed_w, hi_off, hi_scale, _ = lowered_constants(ctx, node, packed, hi)
        _, lo_off, lo_scale, bias_node = lowered_constants(ctx, node, packed, lo)
        target = quantree_ops.conv16.default
        call = (packed_w, hi_off, hi_scale, lo_off, lo_scale, bias_node, *geometry)
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(target, (x, scale, qmin, qmax, *call))
    replace(ctx, node, new, [node, dq, dq.args[0]])  # type: ignore[list-item]
    return True
