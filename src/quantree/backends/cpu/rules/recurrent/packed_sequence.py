"""Packing, unpacking and permuting a packed sequence's int8 rows, without leaving int8.

A model that packs with ``enforce_sorted=False`` sorts its batch (``index_select`` by the
sorted order), packs it (``_pack_padded_sequence``), pads the layer's packed output back
(``_pad_packed_sequence``) and restores the caller's order (``index_select`` again); the
recipe shares one grid across each of those edges, so the reference graph reads
``dq -> op -> q`` on the same grid at every step. Left as they are, each one dequantizes,
moves floats and quantizes again: in the packed-LSTM test model nine quantize and ten
dequantize calls a forward besides the recurrent op. Each is a gather: it copies values, so
on the integers it gives exactly the codes quantize would give back (quantize of a
dequantized code on its own grid is that code). Padding writes ``padding_value``, which the
reference then quantizes: the int8 pad writes that code instead.

Two readers of a dequantized activation that need only its metadata kept the dequantize
running for nothing once the packed rows stay int8: a tensor factory (``nn.RNNBase``'s
default zero state, ``data.new_zeros(...)``, which the capture of a packed layer makes
explicit) reads its dtype and device, export's runtime checks of the packed rows' unbacked
size (``sym_size``) its shape. The factory is made without it (a fixed-shape result is then
folded once, ``passes/fold.py``) and the size is read from the integers.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.patterns import Activation, activation, is_int8_per_tensor, replace
from quantree.core.lower import LoweringContext, Quantized

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
GATHERS = (aten.index_select.default,)
PACKING = (aten._pack_padded_sequence.default, aten._pad_packed_sequence.default)
FACTORIES = {
    aten.new_zeros.default: aten.zeros.default,
    aten.new_ones.default: aten.ones.default,
    aten.new_empty.default: aten.empty.memory_format,
}


def _on_grid(q: Quantized | None, x: Activation) -> bool:
    return (
        q is not None
        and is_int8_per_tensor(q.params)
        and (float(q.params.scale), int(q.params.zero_point)) == (x.scale, x.zero_point)
    )


def lower_gather(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq(x) -> index_select -> q`` on ``x``'s grid: the same rows of the int8 tensor."""
    if node.target not in GATHERS:
        return False
    x = activation(ctx, node.args[0])
    q = ctx.quantized_output(node)
    if x is None or q is None or not _on_grid(q, x):
        return False
    with ctx.gm.graph.inserting_before(node):
        moved = ctx.gm.graph.call_function(node.target, (x.node, *node.args[1:]))
    replace(ctx, q.node, moved, (q.node, node))
    return True


def lower_packing(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq(x) -> pack / pad -> [0] -> q`` on ``x``'s grid: the op on the int8 tensor.

    Both ops return a pair (rows, and the batch sizes or lengths); the other item's readers
    move to the new node's. A pad's ``padding_value`` becomes its code on the grid.
    """
    if node.target not in PACKING or node.kwargs:
        return False
    x = activation(ctx, node.args[0])
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if x is None or len(items) != len(node.users) or 0 not in items:
        return False
    q = ctx.quantized_output(items[0])
    if q is None or not _on_grid(q, x):
        return False
    args: list[Any] = [x.node, *node.args[1:]]
    if node.target is aten._pad_packed_sequence.default:
        value = torch.tensor([float(args[3])])
        code = qd.quantize_per_tensor(value, x.scale, x.zero_point, -128, 127, torch.int8)
        args[3] = float(code.item())
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        moved = graph.call_function(node.target, tuple(args))
        rows = graph.call_function(operator.getitem, (moved, 0))
    for index, item in items.items():
        if index != 0:
            item.args = (moved, index)
    moved.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    replace(ctx, q.node, rows, (q.node, items[0], node))
    return True


def lower_metadata_reads(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq(x).new_zeros(size)`` & co. read nothing of ``dq(x)`` but its float dtype and its
    device: the same factory without it. ``sym_size(dq(x), d)`` is ``x``'s size."""
    dq = ctx.dequantized(node.args[0]) if node.args else None
    if dq is None:
        return False
    if node.target is aten.sym_size.int and not dq.is_constant:
        node.args = (dq.source, *node.args[1:])
        return True
    factory = FACTORIES.get(node.target)  # type: ignore[call-overload]
    if factory is None:
        return False
    like = node.args[0].meta.get("val")  # type: ignore[union-attr]
    if not isinstance(like, torch.Tensor):
        return False
    kwargs = dict(node.kwargs)
    kwargs["dtype"] = kwargs.get("dtype") or like.dtype
    kwargs["device"] = kwargs.get("device") or like.device
    with ctx.gm.graph.inserting_before(node):
        made = ctx.gm.graph.call_function(factory, tuple(node.args[1:]), kwargs)
    made.meta = dict(node.meta)
    node.replace_all_uses_with(made)
    ctx.gm.graph.erase_node(node)
    return True
