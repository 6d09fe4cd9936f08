"""``nn.MultiheadAttention``'s packed q/k/v split read as three column slices.

PyTorch splits the packed input projection as
``proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()`` and
then ``proj[0]``, ``proj[1]``, ``proj[2]``: six dispatcher calls and a copy of the whole
projection, to take columns ``i * E : (i + 1) * E`` of it. Rewritten as those column slices
(each made contiguous, as the views after it need), the split is three ``slice`` +
``contiguous`` pairs a region program runs as copies out of the projection it computes
(``passes/regions.py``); outside a program they are the same values, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten


def _arg(n: fx.Node, i: int) -> Any:
    return n.args[i] if len(n.args) > i else None


def _source(contiguous: fx.Node) -> tuple[fx.Node, int] | None:
    """The projection and E if ``contiguous`` ends the packed split, else None."""
    squeeze = contiguous.args[0]
    if not isinstance(squeeze, fx.Node) or squeeze.target != aten.squeeze.dim:
        return None
    transpose = squeeze.args[0]
    if not isinstance(transpose, fx.Node) or transpose.target != aten.transpose.int:
        return None
    unsqueeze = transpose.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target != aten.unsqueeze.default:
        return None
    unflatten = unsqueeze.args[0]
    if not isinstance(unflatten, fx.Node) or unflatten.target != aten.unflatten.int:
        return None
    proj = unflatten.args[0]
    val = unflatten.meta.get("val")  # (the projection may be a lowered op, without one)
    if not isinstance(proj, fx.Node) or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    sizes = list(_arg(unflatten, 2) or [])
    rank = val.dim() - 1
    if (
        _arg(unflatten, 1) not in (-1, rank - 1)
        or len(sizes) != 2
        or sizes[0] != 3
        or _arg(unsqueeze, 1) != 0
        or [d % (rank + 2) for d in transpose.args[1:3]] != [0, rank]  # type: ignore[operator]
        or _arg(squeeze, 1) % (rank + 2) != rank  # type: ignore[operator]
    ):
        return None
    return proj, int(sizes[1])


def split_packed_qkv(gm: fx.GraphModule) -> int:
    """Rewrite each packed q/k/v split of ``gm`` as column slices; returns how many."""
    graph = gm.graph
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target != aten.contiguous.default:
            continue
        found = _source(n)
        users = list(n.users)
        if found is None or not users:
            continue
        if not all(u.target == aten.select.int and _arg(u, 1) == 0 for u in users):
            continue
        proj, width = found
        for u in users:
            i = int(u.args[2]) % 3  # type: ignore[call-overload]
            with graph.inserting_before(u):
                bounds = (i * width, (i + 1) * width)
                part = graph.call_function(aten.slice.Tensor, (proj, -1, *bounds))
                dense = graph.call_function(aten.contiguous.default, (part,))
            part.meta = {**u.meta}
            dense.meta = {**u.meta}
            u.replace_all_uses_with(dense)
        done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return done
