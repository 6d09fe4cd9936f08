"""Lowering rule for global average pooling between two int8 grids.

Pattern: ``dq(x int8) -> adaptive_avg_pool2d(x, 1) | mean(x, [-2, -1]) -> q``, x 4-d:
the squeeze of a squeeze-excite block, a classifier head's pooling. The replacement sums the
int8 codes as they lie (``ops_mean.py``) instead of dequantizing the whole map to average it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def _global_pooling(node: fx.Node) -> bool | None:
    """``keepdim`` when ``node`` averages a 4-d float tensor over all of H and W, else None."""
    if node.target not in (aten.adaptive_avg_pool2d.default, aten.mean.dim) or len(node.args) < 2:
        return None
    x = node.args[0]
    if not isinstance(x, fx.Node) or "val" not in x.meta or x.meta["val"].dim() != 4:
        return None
    if x.meta["val"].dtype != torch.float32:
        return None
    if node.target is aten.adaptive_avg_pool2d.default:
        size = node.args[1]
        sizes = list(size) if isinstance(size, list | tuple) else [size]
        return True if sizes in ([1], [1, 1]) else None
    if node.target is aten.mean.dim:
        dims = node.args[1]
        ints = [d for d in dims if isinstance(d, int)] if isinstance(dims, list | tuple) else []
        if len(ints) != 2 or sorted(d % 4 for d in ints) != [2, 3]:
            return None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dtype = node.kwargs.get("dtype")
        return bool(keepdim) if dtype in (None, torch.float32) else None
    return None


def lower_mean(ctx: LoweringContext, node: fx.Node) -> bool:
    """``adaptive_avg_pool2d(x, 1)`` / ``mean(x, [2, 3])`` of an int8 map onto an int8 grid."""
    keepdim = _global_pooling(node)
    if keepdim is None:
        return False
    x = activation(ctx, node.args[0])
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    with ctx.gm.graph.inserting_before(node):
        pooled = ctx.gm.graph.call_function(
            torch.ops.quantree.mean_hw.default,
            (x.node, x.scale, x.zero_point, float(q.params.scale), int(q.params.zero_point),
             keepdim),
        )  # fmt: skip
    replace(ctx, q.node, pooled, (q.node, node))
    return True
