"""A stacked ReLU RNN in whole mode: one call per layer, every layer a native kernel.

Found by the outside-models sweep (``benchmarks/outside_models.py``, ``rnn_relu``): the CPU
backend cannot bound the unobserved inner states of a stacked ReLU RNN, so it left the layer
as the reference computes it, a float RNN dequantizing its weights on every call (1.39x
float's CPU time). Split per layer, every state crossing a layer boundary is observed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import batches, leaves, run

THRESHOLD_DB = 35.0


class Stacked(nn.Module):
    def __init__(self, bidirectional: bool, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.RNN(
            8, 16, num_layers=3, nonlinearity="relu", bidirectional=bidirectional,
            batch_first=batch_first,
        )  # fmt: skip

    def forward(self, x, h0):
        return self.rnn(x, h0)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_stacked_relu_rnn_lowers_every_layer(bidirectional, batch_first):
    torch.manual_seed(0)
    model = Stacked(bidirectional, batch_first).eval()
    dirs = 2 if bidirectional else 1
    data = batches((3, 7, 8) if batch_first else (7, 3, 8), (3 * dirs, 3, 16), n=6)
    prepared, ref = run(model, data)
    with torch.no_grad():  # observers return their input: the split layers compute float's
        for want, got in zip(leaves(model(*data[0])), leaves(prepared(*data[0])), strict=True):
            assert torch.equal(want, got)
    targets = [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]
    assert targets.count("aten.rnn_relu.input") == 3
    low = qt.lower(ref, CPU)
    targets = [str(n.target) for n in low.graph.nodes if n.op == "call_function"]
    assert targets.count("quantree.rnn.default") == 3 and "aten.rnn_relu.input" not in targets
    with torch.no_grad():
        for args in data[:3]:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert want.shape == got.shape and qt.sqnr(want, got) >= THRESHOLD_DB


def test_single_layer_and_tanh_are_left_whole():
    torch.manual_seed(0)
    for layer in (nn.RNN(8, 16, nonlinearity="relu"), nn.RNN(8, 16, num_layers=2)):
        _, ref = run(layer.eval(), batches((7, 3, 8), n=3))
        targets = [n.target for n in ref.graph.nodes if n.op == "call_function"]
        assert sum(t in (torch.ops.aten.rnn_relu.input, torch.ops.aten.rnn_tanh.input)
                   for t in targets) == 1  # fmt: skip
