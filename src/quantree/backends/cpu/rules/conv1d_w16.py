"""Lowering rule for 1-d convolutions with int16 weights (``ops/conv1d_w16.py``).

Pattern: ``dq(q(x)) -> conv1d(dq(W int16 per channel), dq(b int32))``, the input per tensor
(int8 with its zero point, or symmetric int16) quantized from a float ``x``, the output
float. What a recipe makes where 8-bit weights bound a layer's accuracy
(``quantree.recipes.wide_weights``). The replacement reads the float ``x`` and quantizes it
inside the op, so no integer tensor is materialised; the int32 bias is dequantized once,
as the reference does on every call.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.ops.conv1d_w16 import packed_w16
from quantree.backends.cpu.rules.linear import conv_geometry
from quantree.backends.patterns import constant, float_constant, replace
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext
from quantree.core.qdq import QUANTIZE_PER_TENSOR
from quantree.core.specs import QDtype

aten = torch.ops.aten

_CONV1D = (aten.conv1d.default, aten.conv1d.padding)
_INPUT_DTYPES = (QDtype.INT8, QDtype.UINT8, QDtype.INT16)


def lower_conv1d_w16(ctx: LoweringContext, node: fx.Node) -> bool:
    """conv1d whose weight is int16 per output channel and whose input is quantized per
    tensor from a float value: one ``quantree.conv1d_w16``, float out."""
    if node.target not in _CONV1D:
        return False
    dq_w = ctx.dequantized(node.args[1])
    if dq_w is None or not dq_w.is_constant:
        return False
    pw = dq_w.params
    if pw.dtype != QDtype.INT16 or pw.axis not in (None, 0) or bool((pw.zero_point != 0).any()):
        return False
    values = fetch_attr(ctx.gm, str(dq_w.source.target))
    if values.dim() != 3:
        return False
    dq = ctx.dequantized(node.args[0])
    if dq is None or dq.is_constant or dq.source.target != QUANTIZE_PER_TENSOR:
        return False
    p = dq.params
    x = dq.source.args[0]
    if p.dtype not in _INPUT_DTYPES or p.axis is not None or not isinstance(x, fx.Node):
        return False
    zero_point = int(p.zero_point.reshape(-1)[0])
    if not -(2**15) <= p.quant_min - zero_point <= p.quant_max - zero_point < 2**15:
        return False
    args = list(node.args) + [None] * (7 - len(node.args))
    geometry = conv_geometry(args, values, 1)
    if geometry is None:
        return False
    out_channels = geometry[0]
    bias = None if args[2] is None else float_constant(ctx, args[2], out_channels)
    if args[2] is not None and bias is None:
        return False
    x_scale = float(p.scale.reshape(-1)[0])
    w_scale = pw.scale.float().reshape(-1).expand(out_channels)
    scale = (torch.tensor(x_scale, dtype=torch.float32) * w_scale).contiguous()
    weight = constant(ctx, "_cpu_weight16_", packed_w16(values), node)
    scale_node = constant(ctx, "_cpu_scale_", scale, node)
    bias_node = None if bias is None else constant(ctx, "_cpu_bias_", bias, node)
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            torch.ops.quantree.conv1d_w16.default,
            (x, x_scale, zero_point, p.quant_min, p.quant_max, weight, scale_node, bias_node,
             *geometry),
        )  # fmt: skip
    replace(ctx, node, new, [node, dq.node, dq.source])
    return True
