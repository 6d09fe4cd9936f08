"""A float group norm and the float ops after it as one ``quantree.norm_block`` call.

HDemucs' residual branches (``DConv``) read ``conv -> group_norm -> gelu -> conv ->
group_norm -> glu -> scale * y -> x + y``; with int16 convolutions between them the norms,
activations, layer scale and residual add stay float, six ATen calls per branch that the
float model pays alike, so the lowered model was no faster than float whatever its
convolutions gained. Each chain ``group_norm -> [gelu | glu(dim 1)] -> [* per-channel
constant] -> [+ tensor of the same shape]``, every intermediate read once, becomes one call
(``ops/norm_block.py``), the same float operations in the same order. A norm followed by
none of these is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu.ops.norm_block import GELU, GLU, NONE
from quantree.core.graphs import attr_at

aten = torch.ops.aten


def _only_user(n: fx.Node, *targets: object) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 and users[0].target in targets else None


def _val(n: object) -> torch.Tensor | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _other(n: fx.Node, one: fx.Node) -> object:
    """The operand of a binary ``n`` that is not ``one`` (None: neither or both are)."""
    a: Any = n.args
    if len(a) != 2 or n.kwargs or (a[0] is one) == (a[1] is one):
        return None
    return a[1] if a[0] is one else a[0]


def _activation(norm: fx.Node, rank: int) -> tuple[int, fx.Node]:
    """``(act, last node)`` of the activation reading ``norm``, or ``(NONE, norm)``."""
    user = _only_user(norm, aten.gelu.default, aten.glu.default)
    if user is None:
        return NONE, norm
    a: Any = user.args
    if user.target is aten.gelu.default:
        approximate = a[1] if len(a) > 1 else user.kwargs.get("approximate", "none")
        return (GELU, user) if approximate == "none" and len(user.kwargs) <= 1 else (NONE, norm)
    dim = a[1] if len(a) > 1 else user.kwargs.get("dim", -1)
    return (GLU, user) if isinstance(dim, int) and dim % rank == 1 else (NONE, norm)


def _per_channel(gm: fx.GraphModule, mul: fx.Node, y: fx.Node) -> fx.Node | None:
    """The float32 constant ``mul`` multiplies ``y [N, C, *]`` by, if it is one value per
    channel broadcast over the rest (a LayerScale's ``scale[:, None]``), and ``mul`` keeps
    ``y``'s shape."""
    scale, val, out = _other(mul, y), _val(y), _val(mul)
    if not isinstance(scale, fx.Node) or scale.op != "get_attr" or val is None or out is None:
        return None
    value = attr_at(gm, str(scale.target))
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    shape = [1] * (val.dim() - value.dim()) + list(value.shape)
    channels = int(val.shape[1])
    expected = [1, channels] + [1] * (val.dim() - 2)
    return scale if shape == expected and out.shape == val.shape else None


def _residual(add: fx.Node, y: fx.Node) -> fx.Node | None:
    """The float32 tensor ``add`` adds to ``y``, if of ``y``'s shape (no broadcast)."""
    other, val, out = _other(add, y), _val(y), _val(add)
    ov = _val(other)
    if not isinstance(other, fx.Node) or ov is None or val is None or out is None:
        return None
    same = ov.shape == val.shape == out.shape and ov.dtype == torch.float32
    return other if same else None


def fuse_norm_blocks(gm: fx.GraphModule) -> int:
    """Replace each float ``quantree.group_norm`` chain of ``gm`` (module docstring) by one
    ``quantree.norm_block``; returns how many."""
    graph, found = gm.graph, 0
    for norm in list(graph.nodes):
        if norm.op != "call_function" or norm.target != torch.ops.quantree.group_norm.default:
            continue
        x = norm.args[0]
        val = _val(norm)  # x's shape and dtype (a native kernel's output carries no val)
        if not isinstance(x, fx.Node) or val is None or val.dtype != torch.float32:
            continue
        act, last = _activation(norm, val.dim())
        chain = [norm] if last is norm else [norm, last]
        scale = residual = None
        mul = _only_user(last, aten.mul.Tensor)
        if mul is not None and (scale := _per_channel(gm, mul, last)) is not None:
            chain.append(mul)
            last = mul
        add = _only_user(last, aten.add.Tensor)
        if add is not None and (residual := _residual(add, last)) is not None:
            chain.append(add)
            last = add
        if len(chain) == 1:
            continue
        _, groups, weight, bias, eps = norm.args
        with graph.inserting_before(last):
            block = graph.call_function(
                torch.ops.quantree.norm_block.default,
                (x, groups, weight, bias, eps, act, scale, residual),
            )
        block.meta = dict(last.meta)
        last.replace_all_uses_with(block)
        for n in reversed(chain):
            graph.erase_node(n)
        found += 1
    if found:
        graph.lint()
        gm.recompile()
    return found
