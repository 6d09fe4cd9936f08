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
