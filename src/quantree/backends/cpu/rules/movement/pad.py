"""``pad`` of int8 values: reflect, replicate and circular copy codes, a zero fill writes
the zero point.

Codecs pad every convolution's input (Encodec's reflect-padded causal convs), Mamba-2 pads
its sequence to whole chunks with zeros. The recipe puts a pad's output on its input's grid
(``recipes/padding.py``), so the padded tensor holds input codes only, and zero where the
fill is 0.0, which every affine grid holds exactly (the zero point). ATen pads int8 tensors
in every mode, so the rule reads the int8 input and pads it: no dequantize, float pad and
quantize between two int8 kernels; a reflect or replicate pad runs as ``quantree.pad_last``
(``ops/pad.py``: one copy per row, where ATen loops per element; other calls go to ATen).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext
from quantree.recipes.padding import pad_fill

aten = torch.ops.aten
quantree_ops = torch.ops.quantree


def lower_pad(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target not in (aten.pad.default, aten.constant_pad_nd.default):
        return False
    x, q = activation(ctx, node.args[0]), ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    if (float(q.params.scale), int(q.params.zero_point)) != (x.scale, x.zero_point):
        return False
    fill = pad_fill(node)
    if fill is not None and fill != 0.0:
        return False
    pad = node.args[1]
    with ctx.gm.graph.inserting_before(node):
        if fill is None:
            mode: Any = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "reflect")
            padded = ctx.gm.graph.call_function(quantree_ops.pad_last.default, (x.node, pad, mode))
        else:
            padded = ctx.gm.graph.call_function(
                aten.constant_pad_nd.default, (x.node, pad, x.zero_point)
            )
    replace(ctx, q.node, padded, (q.node, node))
    return True
