"""Lowering rules for normalizations: a batch norm between two int8 grids (eval mode, not
folded), and float group norms on the native float kernel.

Pattern: ``dq(x int8) -> batch_norm(x, w, b, mean, var, training=False) [-> relu] -> q``.
Batch norm after a convolution or linear is folded into its weights before annotation
(``core/fold.py``); what is left normalises something else: DenseNet's pre-activation norms
read a concatenation (62 of them in densenet121), LeViT's a flattened linear output. The
replacement maps each int8 code per channel (``ops/affine.py``) with the affine terms ATen's
eval batch norm computes, ``alpha = w / sqrt(var + eps)``, ``beta = b - mean * alpha``.

Float group norms: ATen's ``group_norm`` -> ``quantree.group_norm``.

The default recipe leaves a group norm float (its statistics span a whole map: an int8
input would cost accuracy and buy no kernel time), so there is no int8 pattern to match;
the op is swapped for the native float kernel (``ops/group_norm.py``), which reads the
channels-last maps the native convolutions produce as they lie. It still computes in
float and is reported so (``float_report.FLOAT_KERNELS``, ``inspect``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import activation, constant, float_constant, output, replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def affine_terms(
    ctx: LoweringContext, node: fx.Node, channels: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(alpha, beta) float32 ``[C]`` of an eval batch norm, as ATen's CPU kernel forms
    them (float32 throughout: ``1 / sqrt(var + eps)``, times the weight; ``b - mean *
    alpha``), or None when a statistic is not a constant."""
    weight, bias, mean, var = (float_constant(ctx, a, channels) for a in node.args[1:5])
    if node.args[1] is None:
        weight = torch.ones(channels)
    if mean is None or var is None or weight is None or bias is None:
        return None
    if node.args[3] is None or node.args[4] is None:  # batch statistics: training only
        return None
    eps = torch.tensor(float(node.args[7]), dtype=torch.float32)  # type: ignore[arg-type]
    alpha = (1.0 / torch.sqrt(var + eps)) * weight
    return alpha.contiguous(), (bias - mean * alpha).contiguous()


def lower_batch_norm(ctx: LoweringContext, node: fx.Node) -> bool:
    """An eval-mode ``batch_norm`` of an int8 ``[N, C, ...]`` map onto an int8 grid."""
    if node.target is not aten.batch_norm.default or len(node.args) < 8 or node.args[5]:
        return False
    x = activation(ctx, node.args[0])
    out = output(ctx, node, allow_float=False)
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if x is None or out is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    terms = affine_terms(ctx, node, int(val.shape[1]))
    if terms is None:
        return False
    alpha, beta = (constant(ctx, name, t, node) for name, t in zip(
        ("_cpu_bn_alpha_", "_cpu_bn_beta_"), terms, strict=True))  # fmt: skip
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            torch.ops.quantree.channel_affine.default,
            (x.node, x.scale, x.zero_point, alpha, beta, out.scale, out.zero_point, out.relu),
        )
    chain = [out.replaces] + ([next(iter(node.users))] if out.relu else []) + [node]
    replace(ctx, out.replaces, new, chain)
    return True


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
