"""Fold eval-mode batch norm into the conv or linear before it.

A batch norm after a conv is an affine map per output channel; folding it into the weights
and bias leaves one op to quantize instead of a float op between two quantized ones.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.graphs import fetch_attr, register_constant

aten = torch.ops.aten
_FOLDABLE = (aten.conv1d.default, aten.conv2d.default, aten.linear.default)


def _constant(gm: fx.GraphModule, arg: object) -> torch.Tensor | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return fetch_attr(gm, str(arg.target))
    return None


def fold_batch_norm(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``conv/linear -> batch_norm(training=False)`` in place; returns ``gm``."""
    graph = gm.graph
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target is not aten.batch_norm.default:
            continue
        producer, gamma, beta, mean, var, training, _, eps = bn.args[:8]
        if training or not isinstance(producer, fx.Node) or producer.target not in _FOLDABLE:
            continue
        if len(producer.users) != 1:
            continue
        weight = _constant(gm, producer.args[1])
        bias = _constant(gm, producer.args[2]) if len(producer.args) > 2 else None
        stats = [_constant(gm, a) for a in (mean, var)]
        if weight is None or stats[0] is None or stats[1] is None:
            continue
        with torch.no_grad():
            scale = torch.rsqrt(stats[1] + eps)
            if (g := _constant(gm, gamma)) is not None:
                scale = scale * g
            shift = -stats[0] * scale
            if (b := _constant(gm, beta)) is not None:
                shift = shift + b
            if bias is not None:
                shift = shift + bias * scale
            folded = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
        with graph.inserting_before(producer):
            w_node = graph.get_attr(register_constant(gm, "_folded_weight_", folded.detach()))
            b_node = graph.get_attr(register_constant(gm, "_folded_bias_", shift.detach()))
        w_node.meta["val"], b_node.meta["val"] = folded, shift
        args = list(producer.args)
        args[1] = w_node
        if len(args) > 2:
            args[2] = b_node
        else:
            args.append(b_node)
        producer.args = tuple(args)
        bn.replace_all_uses_with(producer)
        graph.erase_node(bn)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm
