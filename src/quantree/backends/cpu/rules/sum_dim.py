"""Lowering rule for a sum over one dimension between two int8 grids.

Pattern: ``dq(x int8) -> sum(x, [dim], keepdim) -> q`` (the default recipe quantizes a float
sum on both sides). The replacement sums the int8 codes (``ops/sum_dim.py``) instead of
dequantizing the whole input to sum it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu.ops import sum_dim as ops_sum_dim  # noqa: F401  (registers the op)
from quantree.backends.patterns import activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def lower_sum_dim(ctx: LoweringContext, node: fx.Node) -> bool:
    """``sum(x, [dim], keepdim)`` of a float32 tensor read from an int8 grid onto an int8 grid."""
    if node.target is not aten.sum.dim_IntList or len(node.args) < 2:
        return False
    dims, source = node.args[1], node.args[0]
    if not isinstance(dims, list | tuple) or len(dims) != 1 or not isinstance(dims[0], int):
        return False
    if node.kwargs.get("dtype") not in (None, torch.float32) or not isinstance(source, fx.Node):
        return False
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or val.dim() == 0:
        return False
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    x = activation(ctx, source)
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    with ctx.gm.graph.inserting_before(node):
        summed = ctx.gm.graph.call_function(
            torch.ops.quantree.sum_dim.default,
            (x.node, dims[0], bool(keepdim), x.scale, x.zero_point, float(q.params.scale),
             int(q.params.zero_point)),
        )  # fmt: skip
    replace(ctx, q.node, summed, (q.node, node))
    return True
