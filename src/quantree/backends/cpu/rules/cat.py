"""``cat`` / ``stack`` of int8 tensors without a float round trip.

``q(cat(dq_a(a), dq_b(b)))`` is ``cat(q(dq_a(a)), q(dq_b(b)))`` element by element, so each
input on the output's grid joins as it is, and one on another grid (an edge the recipe
requantizes) goes through a 256-entry table made with the reference's own q/dq ops: the
result equals the reference bit for bit. Decoders concatenate their state with an attention context
several times per step (Tacotron2: 65 ``cat`` per forward), each once a dequantize, a float
cat and a quantize.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.lookup)
from quantree.backends.cpu.saved.derived import Recipe, derived_constant
from quantree.backends.cpu.saved.derived_ops import table_recipe_args
from quantree.backends.patterns import Activation, activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext, Quantized

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
JOINS = (aten.cat.default, aten.concat.default, aten.stack.default)


def on_grid(ctx: LoweringContext, x: Activation, q: Quantized, before: fx.Node) -> fx.Node:
    """``x``'s integers on ``q``'s grid: itself, or a table lookup requantizing it."""
    scale, zero_point = float(q.params.scale), int(q.params.zero_point)
    if (x.scale, x.zero_point) == (scale, zero_point):
        return x.node
    codes = torch.arange(-128, 128, dtype=torch.int8)
    values = qd.dequantize_per_tensor(codes, x.scale, x.zero_point, -128, 127, torch.int8)
    table = qd.quantize_per_tensor(values, scale, zero_point, -128, 127, torch.int8)
    grids = (x.scale, x.zero_point, scale, zero_point)
    recipe = Recipe(
        torch.ops.quantree.derived_table.default, table_recipe_args("requantize", grids)
    )
    table_node = derived_constant(ctx, "_cpu_requant_", table, before, recipe)
    with ctx.gm.graph.inserting_before(before):
        return ctx.gm.graph.call_function(torch.ops.quantree.lookup.default, (x.node, table_node))


def int8_output(ctx: LoweringContext, node: fx.Node) -> Quantized | None:
    q = ctx.quantized_output(node)
    return q if q is not None and is_int8_per_tensor(q.params) else None


def lower_cat(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq... -> cat/stack -> q`` as the join of the int8 inputs."""
    if node.target not in JOINS or not isinstance(node.args[0], list | tuple):
        return False
    q = int8_output(ctx, node)
    inputs = [activation(ctx, t, allow_constant=True) for t in node.args[0]]
    if q is None or not inputs or any(x is None for x in inputs):
        return False
    joined = [on_grid(ctx, x, q, node) for x in inputs if x is not None]
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(node.target, (joined, *node.args[1:]), dict(node.kwargs))
    replace(ctx, q.node, new, (q.node, node))
    return True
