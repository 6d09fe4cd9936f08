"""``dequantize(int8 table) -> embedding``: gather int8 rows, dequantize what was gathered."""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu.ops import embedding as ops_embedding  # noqa: F401  (registers the op)
from quantree.backends.patterns import replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten


def lower_embedding(ctx: LoweringContext, node: fx.Node) -> bool:
    """An embedding whose table is an int8 (or int16) constant, per tensor or per row."""
    if node.target is not aten.embedding.default:
        return False
    table = ctx.dequantized(node.args[0])
    indices = node.args[1]
    if table is None or not table.is_constant or not isinstance(indices, fx.Node):
        return False
    params = table.params
    if params.axis not in (None, 0) or params.dtype.torch_dtype not in (torch.int8, torch.int16):
        return False
    scale: object
    zero_point: object
    if params.axis is None:
        scale = ctx.add_constant("_cpu_emb_scale_", params.scale.reshape(1).float(), node)
        zero_point = ctx.add_constant("_cpu_emb_zp_", params.zero_point.reshape(1), node)
    else:
        scale, zero_point = table.node.args[1], table.node.args[2]  # the dq's own buffers
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(
            torch.ops.quantree.embedding_rows.default,
            (table.source, scale, zero_point, indices, params.axis == 0),
        )
    new.meta["val"] = node.meta.get("val")
    replace(ctx, node, new, (node, table.node))
    return True
