"""A norm over every dimension but the batch, written out in float ops, as one group norm.

Asteroid's global layer norm (gLN: ConvTasNet, DPRNN, DPTNet, SepFormer's encoders) is
written by hand: ``gamma * (x - mean) / sqrt(var + eps) + beta`` with the mean and the
variance over channels and time. Under ``WEIGHTED_INPUTS`` its ten ops stay float, and each
is an ATen call over the whole map (mean, subtract twice, square, mean, add, sqrt, multiply,
divide, add): they cost a dual-path RNN more than its LSTMs. That is exactly
``group_norm(x, 1, gamma, beta, eps)`` (one group: every channel and position of a sample),
which the native float kernel (``ops/group_norm.py``) computes in one pass over the map,
equal to the written ops up to float rounding.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import replace
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def _float_map(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.dim() >= 3:
        return val
    return None


def _call(node: object, target: object, arity: int | None = None) -> fx.Node | None:
    if not isinstance(node, fx.Node) or node.target is not target or node.kwargs:
        return None
    return node if arity is None or len(node.args) == arity else None


def _mean_of(node: object, rank: int) -> fx.Node | None:
    """The input of ``mean(input, dims, keepdim=True)`` over every dimension but the first."""
    mean = _call(node, aten.mean.dim)
    if mean is None or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    dims = mean.args[1]
    if not isinstance(dims, list | tuple) or not all(isinstance(d, int) for d in dims):
        return None
    if {d % rank for d in dims} != set(range(1, rank)):  # type: ignore[operator]
        return None
    return mean.args[0] if isinstance(mean.args[0], fx.Node) else None


def _centred(node: object, rank: int) -> tuple[fx.Node, fx.Node] | None:
    """(x, the mean node) of ``x - mean(x)``."""
    sub = _call(node, aten.sub.Tensor, 2)
    if sub is None:
        return None
    x, mean = sub.args
    if not isinstance(x, fx.Node) or _mean_of(mean, rank) is not x:
        return None
    return x, mean  # type: ignore[return-value]


def _channel_constant(
    ctx: LoweringContext, node: object, channels: int, rank: int
) -> torch.Tensor | None:
    """A float constant of ``channels`` values broadcast along dimension 1 of a rank-``rank``
    map: ``[1, C, 1, ...]`` or ``[C, 1, ...]``."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = fetch_attr(ctx.gm, str(node.target))
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    axis = {rank: 1, rank - 1: 0}.get(value.dim())
    if axis is None or value.numel() != channels or value.shape[axis] != channels:
        return None
    return value.detach().reshape(channels).contiguous()


def lower_global_norm(ctx: LoweringContext, node: fx.Node) -> bool:
    """``gamma * (x - m) / sqrt(mean((x - m) ** 2) + eps) + beta``, ``m = mean(x)`` over all
    dimensions but the batch (gamma before or after the division), a float ``[N, C, *]``
    ``x`` and per-channel constants: ``quantree.group_norm(x, 1, gamma, beta, eps)``."""
    add = _call(node, aten.add.Tensor, 2)
    val = _float_map(add)
    if add is None or val is None:
        return False
    rank, channels = val.dim(), val.shape[1]
    if not isinstance(channels, int):
        return False
    scaled, beta_node = add.args
    beta = _channel_constant(ctx, beta_node, channels, rank)
    chain: list[fx.Node] = [add]
    gamma_node = None
    div = _call(scaled, aten.div.Tensor, 2)
    if div is None:  # (x - m) / s * gamma
        mul = _call(scaled, aten.mul.Tensor, 2)
        if mul is None:
            return False
        div = next((d for a in mul.args if (d := _call(a, aten.div.Tensor, 2))), None)
        if div is None:
            return False
        gamma_node = next((a for a in mul.args if a is not div), None)
        chain += [mul]
        numerator = div.args[0]
    else:  # gamma * (x - m) / s
        mul = _call(div.args[0], aten.mul.Tensor, 2)
        if mul is None:
            return False
        chain += [div, mul]
        gamma_node = next((a for a in mul.args if _centred(a, rank) is None), None)
        numerator = next((a for a in mul.args if a is not gamma_node), None)
    if div not in chain:
        chain.append(div)
    gamma = _channel_constant(ctx, gamma_node, channels, rank)
    centred = _centred(numerator, rank)
    sqrt = _call(div.args[1], aten.sqrt.default, 1)
    eps_add = _call(sqrt.args[0], aten.add.Tensor, 2) if sqrt is not None else None
    if beta is None or gamma is None or centred is None or eps_add is None:
        return False
    x, mean = centred
    variance, eps = eps_add.args
    if not isinstance(eps, float | int):
        return False
    pow_ = _call(_mean_of(variance, rank), aten.pow.Tensor_Scalar, 2)
    if pow_ is None or pow_.args[1] != 2:
        return False
    squared = _centred(pow_.args[0], rank)
    if squared is None or squared[0] is not x or _float_map(x) is None:
        return False
    with ctx.gm.graph.inserting_before(node):
        weight = ctx.add_constant("_cpu_norm_weight_", gamma, before=node)
        bias = ctx.add_constant("_cpu_norm_bias_", beta, before=node)
        normed = ctx.gm.graph.call_function(
            torch.ops.quantree.group_norm.default, (x, 1, weight, bias, float(eps))
        )
    normed.meta["val"] = val
    inner = [sqrt, eps_add, variance, pow_, pow_.args[0], numerator, mean]
    dead = list(dict.fromkeys([*chain, *inner]))  # users first; a shared x - m once
    replace(ctx, node, normed, dead)  # type: ignore[arg-type]
    return True
