"""Lowering rule for a cumulative sum between two int8 grids.

Pattern: ``dq(x int8) -> cumsum(x, dim) -> q``, where a quantizer quantizes ``cumsum`` on both
sides (the default recipe leaves it float, so this rule changes nothing there). The
replacement sums the int8 codes (``ops/cumsum.py``) instead of dequantizing the input.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu.ops import cumsum as ops_cumsum  # noqa: F401  (registers the op)
from quantree.backends.patterns import activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def lower_cumsum(ctx: LoweringContext, node: fx.Node) -> bool:
    """``cumsum(x, dim)`` of a float32 tensor read from an int8 grid onto an int8 grid."""
    if node.target is not aten.cumsum.default or len(node.args) < 2:
        return False
    source, dim = node.args[0], node.args[1]
    if not isinstance(dim, int) or not isinstance(source, fx.Node):
        return False
    dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    val = source.meta.get("val")
    if dtype not in (None, torch.float32) or not isinstance(val, torch.Tensor):
        return False
    if val.dtype != torch.float32 or val.dim() == 0:
        return False
    x = activation(ctx, source)
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    with ctx.gm.graph.inserting_before(node):
        totals = ctx.gm.graph.call_function(
            torch.ops.quantree.cumsum.default,
            (x.node, dim, x.scale, x.zero_point, float(q.params.scale), int(q.params.zero_point)),
        )
    replace(ctx, q.node, totals, (q.node, node))
    return True
