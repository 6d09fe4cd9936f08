"""int16-input linears that read one input on one grid, run as one call.

Attention's q, k and v projections (BERT, ViT, any model that writes three ``nn.Linear``
layers rather than one packed in-projection) each quantize the same float input to int16 on
the same scale (one sharing group) and multiply it by their own weight: three calls that
each quantize and split the input again and read it once more. Their packed weights are
blocks of 16 output channels (``native/packing.py``), so when every layer's width is a
multiple of 16 the weights, offsets, scales and biases concatenated are one layer's, whose
output columns are the three outputs side by side: the same kernel computes every column as
before, bit for bit, and each former output is a column slice (a view) of the one result.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.linear16)
from quantree.core.graphs import fetch_attr, register_constant

aten = torch.ops.aten
LINEAR16 = torch.ops.quantree.linear16.default


def _constants(gm: fx.GraphModule, n: fx.Node) -> list[torch.Tensor] | None:
    """weight, offset, scale (and bias, if any) of a linear16 node, when all are constants
    and its width fills whole blocks of 16 channels."""
    a: Any = n.args
    if n.kwargs or len(a) != 9 or not isinstance(a[8], int) or a[8] % 16:
        return None
    found = []
    for arg in a[4:8]:
        if arg is None:
            continue
        if not isinstance(arg, fx.Node) or arg.op != "get_attr":
            return None
        found.append(fetch_attr(gm, str(arg.target)))
    weight = found[0]
    if weight.dim() != 3 or weight.shape[0] * 16 != a[8]:
        return None
    return found


def merge_sibling_linears(gm: fx.GraphModule) -> int:
    """Join each set of linear16 nodes reading one input with one input grid (and a bias
    either all or none) into one call and column slices; returns how many calls it saved."""
    graph = gm.graph
    groups: dict[tuple, list[tuple[fx.Node, list[torch.Tensor]]]] = collections.defaultdict(list)
    for n in graph.nodes:
        if n.op != "call_function" or n.target != LINEAR16:
            continue
        consts = _constants(gm, n)
        if consts is None:
            continue
        x, x_scale, qmin, qmax = n.args[:4]
        key = (x, float(x_scale), int(qmin), int(qmax), n.args[7] is None, consts[0].shape[1])
        groups[key].append((n, consts))
    saved = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0][0]
        names = [
            register_constant(gm, f"_cpu_joined_{part}_", torch.cat([c[i] for _, c in members]))
            for i, part in enumerate(("weight", "offset", "scale", "bias")[: len(members[0][1])])
        ]
        widths: list[int] = [n.args[8] for n, _ in members]  # type: ignore[misc]
        width = sum(widths)
        with graph.inserting_before(first):
            attrs = [graph.get_attr(name) for name in names]
            bias = attrs[3] if len(attrs) == 4 else None
            joined = graph.call_function(LINEAR16, (*first.args[:4], *attrs[:3], bias, width))
        val = first.meta.get("val")
        if isinstance(val, torch.Tensor):
            joined.meta["val"] = val.new_empty((*val.shape[:-1], width))
        start = 0
        for (n, _), w in zip(members, widths, strict=True):
            end = start + w
            with graph.inserting_before(n):
                part = graph.call_function(aten.slice.Tensor, (joined, -1, start, end))
            if isinstance(joined.meta.get("val"), torch.Tensor):
                part.meta["val"] = joined.meta["val"][..., start:end]
            n.replace_all_uses_with(part)
            reads = [a for a in n.args[4:8] if isinstance(a, fx.Node)]
            graph.erase_node(n)
            for attr in reads:  # the layer's own constants, read by nothing now
                if not attr.users:
                    graph.erase_node(attr)
            start = end
        saved += len(members) - 1
    if saved:
        graph.lint()
        gm.recompile()
    return saved
