"""Views that keep an int8 tensor's values (``alias``, ``slice``, ``narrow``, ``select``)
run on the int8 tensor: no dequantize and quantize onto the same grid around them.

GhostNet's module returns ``cat([primary, cheap], 1)[:, :out_chs]``; export writes the
full-width slice as an ``alias``. Each one dequantized and quantized the whole map again
(lowered ghostnet_100 0.87x float CPU time, 0.53x after, load 5-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_exact import POW2
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import batches, leaves, run

native = torch.ops.quantree


class Ghost(nn.Module):
    def __init__(self, keep: int) -> None:
        super().__init__()
        self.primary = nn.Conv2d(8, 8, 1)
        self.cheap = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.next = nn.Conv2d(keep, 8, 1)
        self.keep = keep

    def forward(self, x):
        a = F.relu(self.primary(x))
        out = torch.cat([a, F.relu(self.cheap(a))], 1)[:, : self.keep]
        return self.next(out)


@pytest.mark.parametrize("keep", [16, 12], ids=["alias", "slice"])
def test_view_of_int8_map_needs_no_requantization(keep):
    torch.manual_seed(0)
    data = batches((2, 8, 10, 10), n=4)
    _, ref = run(Ghost(keep).eval(), data, POW2)
    low = qt.lower(ref, CPU)
    targets = [n.target for n in low.graph.nodes if n.op == "call_function"]
    assert targets.count(native.quantize.default) == 1  # the model's input only
    assert native.dequantize.default not in targets[:-1]  # the output only
    with torch.no_grad():
        for args in data:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert torch.equal(want, got)


class PaddedSlice(nn.Module):
    """Encodec's padded conv input: ``pad(x, (k - 1, extra))[..., :end]`` into a conv, or
    views that move the values (a permute and a transpose back)."""

    def __init__(self, moved: bool, twice: bool = False) -> None:
        super().__init__()
        self.first = nn.Conv1d(4, 8, 3)
        self.second = nn.Conv1d(8, 8, 3)
        self.other = nn.Conv1d(8, 8, 1) if twice else None
        self.moved = moved

    def forward(self, x):
        y = F.pad(self.first(x), (2, 1), mode="reflect")[..., : x.shape[-1] - 1]
        if self.moved:
            y = y.permute(0, 2, 1).transpose(1, 2)
        out = self.second(y)
        return out if self.other is None else (out, self.other(y))


def regrid_view_outputs(ref: torch.fx.GraphModule) -> int:
    """Moves every quantize that reads a view onto another grid (as a refined conv input
    grid does), returning how many: the lowering must follow whatever grids convert made."""
    views = {torch.ops.aten.slice.Tensor, torch.ops.aten.transpose.int}
    moved = 0
    for node in ref.graph.nodes:
        if node.target == torch.ops.quantized_decomposed.quantize_per_tensor.default:
            src = node.args[0]
            if isinstance(src, torch.fx.Node) and src.target in views:
                node.args = (src, float(node.args[1]) * 1.37, int(node.args[2]) + 3, *node.args[3:])
                moved += 1
    ref.recompile()
    return moved


@pytest.mark.parametrize(
    ("moved", "twice"),
    [(False, False), (True, False), (False, True)],
    ids=["slice", "slice_permute_transpose", "read_twice"],
)
def test_views_onto_another_grid_are_an_int8_view_and_a_table(moved, twice):
    """``dq -> views -> q`` on another grid: the views on int8 and one requantizing table,
    no float copy, one table for two quantizes of the same arguments (a view read by two
    convs); equal to the reference bit for bit (the table is made with its q/dq)."""
    torch.manual_seed(0)
    data = batches((2, 4, 24), n=4)
    _, ref = run(PaddedSlice(moved, twice).eval(), data)
    assert regrid_view_outputs(ref) == (2 if twice else 1)
    low = qt.lower(ref, CPU)
    targets = [n.target for n in low.graph.nodes if n.op == "call_function"]
    assert targets.count(native.lookup.default) == 1
    assert targets.count(native.quantize.default) == 1  # the model's input only
    assert targets.count(native.dequantize.default) == (2 if twice else 1)  # the outputs'
    with torch.no_grad():
        for args in data:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert torch.equal(want, got)
