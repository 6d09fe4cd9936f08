"""Lowering rule for a chain of views between a dequantize and a quantize on one grid.

Pattern: ``dq(x int8) -> view -> view ... -> q`` where each view keeps the values (slices,
``alias``, reshapes, permutes) and ``q`` is on ``x``'s grid. Export writes ``t[:, :n]`` as
two slices (one over the batch), which ``lower_movement`` (one op between dq and q) does
not see; GhostNet's ``cat(...)[:, :out_chs]`` then dequantized and quantized the whole
map again. The views now run on the int8 tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu.rules.qdq import MOVEMENT
from quantree.backends.patterns import activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def lower_view_chain(ctx: LoweringContext, node: fx.Node) -> bool:
    """``node`` the first of two or more views read once each, ending in a same-grid q."""
    if node.target not in MOVEMENT:
        return False
    x = activation(ctx, node.args[0])
    if x is None:
        return False
    chain = [node]
    while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target in MOVEMENT:
        nxt = next(iter(chain[-1].users))
        if nxt.args[0] is not chain[-1]:
            break
        chain.append(nxt)
    q = ctx.quantized_output(chain[-1])
    if len(chain) < 2 or q is None or not is_int8_per_tensor(q.params):
        return False
    if (float(q.params.scale), int(q.params.zero_point)) != (x.scale, x.zero_point):
        return False
    graph, source = ctx.gm.graph, x.node
    with graph.inserting_before(chain[-1]):
        for view in chain:  # int8 maps may be channels-last: reshape is a view where it can be
            target: Any = aten.reshape.default if view.target == aten.view.default else view.target
            source = graph.call_function(target, (source, *view.args[1:]), dict(view.kwargs))
    replace(ctx, q.node, source, (q.node, *reversed(chain)))
    return True
