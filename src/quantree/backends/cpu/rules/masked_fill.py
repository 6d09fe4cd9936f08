"""``dq -> masked_fill(mask, value) -> q`` as a select between int8 codes.

Quantization is elementwise, so ``q(masked_fill(dq(x), mask, v))`` is ``q(v)`` where the mask
is set and ``q(dq(x))`` elsewhere: the fill value's code is computed once with the
reference's own quantize (an attention mask's ``-inf`` becomes the grid's lowest code, as the
reference clamps it), and ``x`` joins on the output's grid as it is or through a 256-entry
requantization table. The result equals the reference bit for bit. Attention layers mask their
scores this way before a softmax (Tacotron2: once per decoder step), each once a dequantize,
a float ``masked_fill`` and a quantize.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from quantree.backends.cpu.rules.cat import int8_output, on_grid
from quantree.backends.patterns import activation, replace, writes_shared_input
from quantree.core.lower import LoweringContext

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
MASKED_FILL = (aten.masked_fill.Scalar, aten.masked_fill_.Scalar)


def lower_masked_fill(ctx: LoweringContext, node: fx.Node) -> bool:
    """An int8 activation filled with a number where a boolean mask is set, int8 out."""
    if node.target not in MASKED_FILL or len(node.args) != 3 or writes_shared_input(node):
        return False
    x_arg, mask, value = node.args
    if not isinstance(mask, fx.Node) or not isinstance(value, int | float) or math.isnan(value):
        return False
    mask_val = mask.meta.get("val")
    if not isinstance(mask_val, torch.Tensor) or mask_val.dtype != torch.bool:
        return False
    x = activation(ctx, x_arg)
    q = int8_output(ctx, node)
    if x is None or q is None:
        return False
    scale, zero_point = float(q.params.scale), int(q.params.zero_point)
    fill = torch.tensor(float(value), dtype=torch.float32)
    code = qd.quantize_per_tensor(fill, scale, zero_point, -128, 127, torch.int8)
    fill_node = ctx.add_constant("_cpu_fill_", code, before=node)
    joined = on_grid(ctx, x, q, node)
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(aten.where.self, (mask, fill_node, joined))
    replace(ctx, q.node, new, (q.node, node))
    return True
