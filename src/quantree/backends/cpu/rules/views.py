"""Lowering rule for a chain of views between a dequantize and a quantize on one grid.

Pattern: ``dq(x int8) -> view -> view ... -> q`` where each view keeps the values (slices,
``alias``, reshapes, permutes) and ``q`` is on ``x``'s grid. Export writes ``t[:, :n]`` as
two slices (one over the batch), which ``lower_movement`` (one op between dq and q) does
not see; GhostNet's ``cat(...)[:, :out_chs]`` then dequantized and quantized the whole
map again. The views now run on the int8 tensor.

Where the quantize is on another grid (``lower_requantized_views``: a refined input grid of
a convolution reading a slice, Encodec's ``pad -> dq -> [..., :end] -> q`` before every
strided conv), the views run on the int8 tensor and a 256-entry table made with the
reference's own q/dq ops requantizes the codes (``rules/cat.on_grid``): a dequantize, a float
view copy and a quantize become one int8 view and one table lookup, equal bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu.rules.cat import on_grid
from quantree.backends.cpu.rules.qdq import MOVEMENT
from quantree.backends.patterns import Activation, activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext, Quantized
from quantree.core.qdq import QUANTIZE_OPS, params_of

aten = torch.ops.aten


def view_chain(
    ctx: LoweringContext, node: fx.Node
) -> tuple[Activation, list[fx.Node], Quantized, list[fx.Node]] | None:
    """The int8 input, the views from ``node`` on (each read once by the next), the int8
    quantize that reads the last of them and the other quantizes reading it with the very
    same arguments (convert writes one per use: Encodec's slice after each transposed conv
    is quantized twice, for the shortcut and for the ELU's table)."""
    if node.target not in MOVEMENT:
        return None
    x = activation(ctx, node.args[0])
    if x is None:
        return None
    chain = [node]
    while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target in MOVEMENT:
        nxt = next(iter(chain[-1].users))
        if nxt.args[0] is not chain[-1]:
            break
        chain.append(nxt)
    users = list(chain[-1].users)
    first = users[0] if users else None
    if first is None or any(
        u.target not in QUANTIZE_OPS
        or u.target != first.target
        or u.args[1:] != first.args[1:]
        or u.kwargs != first.kwargs
        for u in users
    ):
        return None
    q = Quantized(first, params_of(first, ctx.gm))
    if not is_int8_per_tensor(q.params):
        return None
    return x, chain, q, users[1:]


def replace_all(
    ctx: LoweringContext, q: Quantized, same: list[fx.Node], new: fx.Node, chain: list[fx.Node]
) -> None:
    """Every quantize of the chain's end routed to ``new``, then the dead chain erased."""
    for other in same:
        replace(ctx, other, new, (other,))
    replace(ctx, q.node, new, (q.node, *reversed(chain)))


def views_on_int8(ctx: LoweringContext, source: fx.Node, chain: list[fx.Node]) -> fx.Node:
    """The chain's views applied to ``source``, inserted before the chain's last node."""
    graph = ctx.gm.graph
    with graph.inserting_before(chain[-1]):
        for view in chain:  # int8 maps may be channels-last: reshape is a view where it can be
            target: Any = aten.reshape.default if view.target == aten.view.default else view.target
            source = graph.call_function(target, (source, *view.args[1:]), dict(view.kwargs))
    return source


def lower_view_chain(ctx: LoweringContext, node: fx.Node) -> bool:
    """``node`` the first of two or more views read once each, ending in a same-grid q."""
    found = view_chain(ctx, node)
    if found is None:
        return False
    x, chain, q, same = found
    if len(chain) < 2 or (float(q.params.scale), int(q.params.zero_point)) != (
        x.scale,
        x.zero_point,
    ):
        return False
    replace_all(ctx, q, same, views_on_int8(ctx, x.node, chain), chain)
    return True


def lower_requantized_views(ctx: LoweringContext, node: fx.Node) -> bool:
    """``node`` the first of one or more views read once each, ending in a q on a grid other
    than the input's: the views on int8, then a requantizing table."""
    found = view_chain(ctx, node)
    if found is None:
        return False
    x, chain, q, same = found
    if (float(q.params.scale), int(q.params.zero_point)) == (x.scale, x.zero_point):
        return False  # lower_view_chain / lower_movement
    moved = views_on_int8(ctx, x.node, chain)
    requantized = on_grid(ctx, Activation(moved, x.scale, x.zero_point), q, chain[-1])
    replace_all(ctx, q, same, requantized, chain)
    return True
