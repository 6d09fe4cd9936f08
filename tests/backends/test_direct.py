"""Lowered graphs call their ops' implementations directly; saved programs hold the ops."""

from __future__ import annotations

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.direct import DirectCall

from support import batches, run


def test_lowered_targets_call_directly_and_save_as_ops(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    data = batches((2, 3, 8, 8), n=3)
    _, ref = run(model.eval(), data)
    low = qt.lower(ref, CPU)
    direct = [n.target for n in low.graph.nodes if isinstance(n.target, DirectCall)]
    assert {str(t) for t in direct} >= {"quantree.conv2d.default", "quantree.linear.default"}
    assert torch.ops.quantree.conv2d.default in {n.target for n in low.graph.nodes}
    save(low, tmp_path / "m.pt2", data[0])
    saved = torch.export.load(str(tmp_path / "m.pt2")).graph_module
    assert not any(isinstance(n.target, DirectCall) for n in saved.graph.nodes)
    assert torch.ops.quantree.conv2d.default in {n.target for n in saved.graph.nodes}
    loaded = load(tmp_path / "m.pt2")
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), low(*data[1]))
