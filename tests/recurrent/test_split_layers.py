"""Stacked recurrent calls in whole mode: one call per layer, every layer a native kernel.

Found by the outside-models sweep (``benchmarks/outside_models.py``, ``rnn_relu``): the CPU
backend cannot bound the unobserved inner states of a stacked ReLU RNN, so it left the layer
as the reference computes it, a float RNN dequantizing its weights on every call (1.39x
float's CPU time). Split per layer, every state crossing a layer boundary is observed. LSTM,
GRU and tanh stacks are split too (their inner layers were carried at int16, two byte-plane
passes): ``split_layers=False`` keeps them whole.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import batches, leaves, run

THRESHOLD_DB = 30.0  # lowered against the reference graph; random weights measure 36-45 dB
LAYER_OPS = {
    "relu": "aten.rnn_relu.input",
    "tanh": "aten.rnn_tanh.input",
    "gru": "aten.gru.input",
    "lstm": "aten.lstm.input",
    "lstm_proj": "aten.lstm.input",
}


def stacked(kind: str, bidirectional: bool, batch_first: bool) -> nn.Module:
    common = {"num_layers": 3, "bidirectional": bidirectional, "batch_first": batch_first}
    if kind in ("relu", "tanh"):
        return nn.RNN(8, 16, nonlinearity=kind, **common)
    if kind == "gru":
        return nn.GRU(8, 16, **common)
    return nn.LSTM(8, 16, proj_size=6 if kind == "lstm_proj" else 0, **common)


def stacked_data(kind: str, bidirectional: bool, batch_first: bool) -> list[tuple]:
    dirs = 2 if bidirectional else 1
    x = (3, 7, 8) if batch_first else (7, 3, 8)
    h = (3 * dirs, 3, 6 if kind == "lstm_proj" else 16)
    if kind.startswith("lstm"):
        return [(a, (b, c)) for a, b, c in batches(x, h, (3 * dirs, 3, 16), n=6)]
    return batches(x, h, n=6)


@pytest.mark.parametrize("kind", sorted(LAYER_OPS))
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_stacked_call_lowers_every_layer(kind, bidirectional, batch_first):
    torch.manual_seed(0)
    model = stacked(kind, bidirectional, batch_first).eval()
    data = stacked_data(kind, bidirectional, batch_first)
    prepared, ref = run(model, data)
    with torch.no_grad():  # observers return their input: the split layers compute float's
        for want, got in zip(leaves(model(*data[0])), leaves(prepared(*data[0])), strict=True):
            assert want.shape == got.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # float's own kernels
    targets = [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]
    assert targets.count(LAYER_OPS[kind]) == 3
    low = qt.lower(ref, CPU)
    targets = [str(n.target) for n in low.graph.nodes if n.op == "call_function"]
    assert targets.count("quantree.rnn.default") == 3 and LAYER_OPS[kind] not in targets
    with torch.no_grad():
        for args in data[:3]:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert want.shape == got.shape and qt.sqnr(want, got) >= THRESHOLD_DB


@pytest.mark.parametrize("kind", ["tanh", "gru", "lstm"])
def test_split_layers_false_keeps_bounded_stacks_whole(kind):
    torch.manual_seed(0)
    model = stacked(kind, False, False).eval()
    _, ref = run(model, stacked_data(kind, False, False), qt.Int8Quantizer(split_layers=False))
    targets = [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]
    assert targets.count(LAYER_OPS[kind]) == 1


def test_relu_stack_is_split_even_when_asked_not_to():
    """Nothing bounds a ReLU RNN's inner states: whole, the backend could not lower it."""
    torch.manual_seed(0)
    model = stacked("relu", False, False).eval()
    _, ref = run(model, stacked_data("relu", False, False), qt.Int8Quantizer(split_layers=False))
    targets = [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]
    assert targets.count(LAYER_OPS["relu"]) == 3


def test_single_layers_are_left_whole():
    torch.manual_seed(0)
    for layer in (nn.RNN(8, 16, nonlinearity="relu"), nn.GRU(8, 16), nn.LSTM(8, 16)):
        _, ref = run(layer.eval(), batches((7, 3, 8), n=3))
        targets = [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]
        assert sum(t in LAYER_OPS.values() for t in targets) == 1


def test_split_layers_must_be_a_bool():
    with pytest.raises(qt.QuantreeError, match="split_layers must be True or False"):
        qt.Int8Quantizer(split_layers="yes")  # type: ignore[arg-type]


class PackedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(6, 10, 2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return out


def test_packed_stacks_are_split_too():
    """Packed input is quantized as padded input is: one native packed call per layer."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 9, 6, generator=g), torch.tensor([4, 9, 2, 7, 4])) for _ in range(4)]
    model = PackedStack().eval()
    _, ref = run(model, data)
    targets = [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]
    assert targets.count("aten.gru.data") == 2
    low = qt.lower(ref, CPU)
    assert sum("rnn_packed_sequence" in str(n.target) for n in low.graph.nodes) == 2
    with torch.no_grad():
        for args in data[:2]:
            assert qt.sqnr(ref(*args), low(*args)) >= THRESHOLD_DB
