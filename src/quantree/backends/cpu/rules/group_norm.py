"""Lowering rule for float group norms: ATen's ``group_norm`` -> ``quantree.group_norm``.

The default recipe leaves a group norm float (its statistics span a whole map: an int8
input would cost accuracy and buy no kernel time), so there is no int8 pattern to match;
the op is swapped for the native float kernel (``ops_group_norm.py``), which reads the
channels-last maps the native convolutions produce as they lie. It still computes in
float and is reported so (``float_report.FLOAT_KERNELS``, ``inspect``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def _float32(arg: object, dims: int | None = None) -> bool:
    if arg is None:
        return True
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return False
    return dims is None or val.dim() >= dims


def lower_group_norm(ctx: LoweringContext, node: fx.Node) -> bool:
    """``group_norm(x, groups, weight, bias, eps)`` of a float ``[N, C, *]`` map."""
    if node.target is not aten.group_norm.default:
        return False
    args = [*node.args, *([None] * 6)][:6]
    x, groups = args[0], args[1]
    weight = node.kwargs.get("weight", args[2])
    bias = node.kwargs.get("bias", args[3])
    eps = node.kwargs.get("eps", 1e-5 if args[4] is None else args[4])
    # the output's shape and dtype are the input's (which a lowered producer may not record)
    if not (isinstance(x, fx.Node) and _float32(node, dims=3)):
        return False
    if not (_float32(weight) and _float32(bias)):
        return False
    if not isinstance(groups, int) or not isinstance(eps, float | int):
        return False
    channels = node.meta["val"].shape[1]
    if not isinstance(channels, int) or groups < 1 or channels % groups:
        return False  # ATen's error is the user's
    with ctx.gm.graph.inserting_before(node):
        normed = ctx.gm.graph.call_function(
            torch.ops.quantree.group_norm.default, (x, groups, weight, bias, float(eps))
        )
    normed.meta.update(node.meta)
    replace(ctx, node, normed, (node,))
    return True
