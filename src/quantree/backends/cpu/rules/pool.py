"""Lowering rules for average pooling between two int8 grids: windowed, and global.

Pattern: ``dq(x int8) -> avg_pool2d(x, ...) | adaptive_avg_pool2d(x, size) -> q``, x 4-d:
DenseNet's transitions, Inception's branch pools, PoolFormer's token mixer. Without it each
was a float island (the map dequantized, pooled in float, quantized again). The replacement
sums the int8 codes of each window (``ops.pool.avg_pool2d``). An ``adaptive_avg_pool2d``
whose output size divides its input's is the same fixed-window pool; global pooling (size 1)
is ``lower_mean``'s, other adaptive sizes (overlapping windows) stay with ATen.

Global average pooling: ``dq(x int8) -> adaptive_avg_pool2d(x, 1) | mean(x, [-2, -1]) -> q``,
x 4-d: the squeeze of a squeeze-excite block, a classifier head's pooling. The replacement
sums the int8 codes as they lie (``ops/pool.py``) instead of dequantizing the whole map to
average it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import Activation, activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext
from quantree.core.specs import QParams

aten = torch.ops.aten
Geometry = tuple[list[int], list[int], list[int], bool, bool, int]
"""kernel, stride, padding, ceil_mode, count_include_pad, divisor_override (0: none)."""


def _pair(value: Any) -> list[int] | None:
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not all(isinstance(v, int) for v in values) or len(values) not in (1, 2):
        return None
    return values * 2 if len(values) == 1 else values


def _geometry(node: fx.Node) -> Geometry | None:
    """The fixed-window geometry ``node`` pools its 4-d float input with, or None."""
    x = node.args[0]
    if not isinstance(x, fx.Node) or "val" not in x.meta:
        return None
    val = x.meta["val"]
    if val.dim() != 4 or val.dtype != torch.float32:
        return None
    if node.target is aten.avg_pool2d.default:
        args: list[Any] = [*node.args, *([None] * 7)][:7]
        kernel = _pair(args[1])
        stride = _pair(args[2]) if args[2] else kernel
        padding = _pair(args[3] if args[3] is not None else 0)
        if kernel is None or stride is None or padding is None:
            return None
        ceil_mode = bool(node.kwargs.get("ceil_mode", args[4] or False))
        include = node.kwargs.get("count_include_pad", args[5])
        divisor = node.kwargs.get("divisor_override", args[6])
        return kernel, stride, padding, ceil_mode, include is None or bool(include), divisor or 0
    if node.target is aten.adaptive_avg_pool2d.default:
        size = _pair(node.args[1])
        hw = [val.shape[2], val.shape[3]]
        if size is None or size == [1, 1] or not all(isinstance(d, int) for d in hw):
            return None  # global pooling is lower_mean's; a symbolic size has no fixed window
        if any(s <= 0 or d % s for d, s in zip(hw, size, strict=True)):
            return None  # windows of different sizes (ATen's floor/ceil bounds) overlap
        kernel = [d // s for d, s in zip(hw, size, strict=True)]
        return kernel, kernel, [0, 0], False, True, 0
    return None


def lower_avg_pool(ctx: LoweringContext, node: fx.Node) -> bool:
    """``avg_pool2d`` / evenly dividing ``adaptive_avg_pool2d`` of an int8 map onto an int8
    grid."""
    if node.target not in (aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default):
        return False
    geometry = _geometry(node)
    if geometry is None:
        return False
    kernel, stride, padding, ceil_mode, include, divisor = geometry
    if any(2 * p > k for p, k in zip(padding, kernel, strict=True)):
        return False  # ATen refuses it too; its error is the user's
    return _int8_pooling(
        ctx, node, torch.ops.quantree.avg_pool2d.default,
        lambda x, out: (x.node, kernel, stride, padding, ceil_mode, include, divisor, x.scale,
                        x.zero_point, float(out.scale), int(out.zero_point)),
    )  # fmt: skip


def _int8_pooling(
    ctx: LoweringContext,
    node: fx.Node,
    op: torch._ops.OpOverload,
    op_args: Callable[[Activation, QParams], tuple[Any, ...]],
) -> bool:
    """Replace ``dq(x) -> node -> q``, both int8 per tensor, by ``op(*op_args(x, q's grid))``."""
    x = activation(ctx, node.args[0])
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    with ctx.gm.graph.inserting_before(node):
        pooled = ctx.gm.graph.call_function(op, op_args(x, q.params))
    replace(ctx, q.node, pooled, (q.node, node))
    return True


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
    return _int8_pooling(
        ctx, node, torch.ops.quantree.mean_hw.default,
        lambda x, out: (x.node, x.scale, x.zero_point, float(out.scale), int(out.zero_point),
                        keepdim),
    )  # fmt: skip
