"""Lowering of ``dq -> glu(dim) -> q`` on int8 per-tensor grids (``quantree.glu``).

A GLU's output depends on two input codes (``a`` and the gate ``b``), so it is no 256-entry
table; the gate's sigmoid depends on ``b``'s code alone, so its 256 values are computed here
with aten's ``glu`` itself (a unit ``a``: the product is the sigmoid exactly, rounded as the
reference rounds it) and the kernel multiplies and requantizes as the reference does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.patterns import activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


def gate_table(scale: float, zero_point: int) -> torch.Tensor:
    """The 256 float sigmoids of the gate's codes -128..127 as ``aten.glu`` computes them."""
    codes = torch.arange(-128, 128, dtype=torch.int8)
    b = qd.dequantize_per_tensor(codes, scale, zero_point, -128, 127, torch.int8)
    return aten.glu.default(torch.stack([torch.ones_like(b), b]), 0).contiguous()


def lower_glu(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq(x) -> glu(dim) -> q``, x and the result int8 per tensor: one native pass."""
    if node.target is not aten.glu.default:
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    x, q = activation(ctx, node.args[0]), ctx.quantized_output(node)
    if not isinstance(dim, int) or x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    gate = ctx.add_constant("_cpu_gate_", gate_table(x.scale, x.zero_point), before=node)
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            torch.ops.quantree.glu.default,
            (x.node, dim, gate, x.scale, x.zero_point, float(q.params.scale),
             int(q.params.zero_point)),
        )  # fmt: skip
    replace(ctx, q.node, new, (q.node, node))
    return True
