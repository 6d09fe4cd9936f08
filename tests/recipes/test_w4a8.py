"""W4A8Quantizer: 4-bit per-channel weights as pt2e writes them (int8 storage on [-8, 7]) on
linear, conv and whole-mode recurrent weights; int8 embedding tables unless asked; range
search and refine keep every weight integer on the 4-bit grid."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.core.graphs import nested_graphs
from quantree.core.qdq import DEQUANTIZE_PER_CHANNEL, QUANTIZE_PER_CHANNEL


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.out = nn.Linear(12, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        y, _ = self.lstm(x)
        return self.out(y)


def _data(n: int = 6) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 20, (3, 7), generator=g),) for _ in range(n)]


def _weight_ranges(ref: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Each per-channel int8 weight's (quant_min, quant_max), by the tensor it reads."""
    ranges = {}
    for node in ref.graph.nodes:
        if (
            node.target in (DEQUANTIZE_PER_CHANNEL, QUANTIZE_PER_CHANNEL)
            and node.args[-1] == torch.int8
        ):
            ranges[str(node.args[0])] = tuple(node.args[-3:-1])
    return ranges


def _reference(quantizer: qt.Quantizer, refine: bool = False) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model, data = Mixed().eval(), _data()
    prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    return qt.refine(prepared, ref, data) if refine else ref


def test_weights_are_on_the_4_bit_grid_and_the_embedding_table_on_int8() -> None:
    ranges = _reference(qt.W4A8Quantizer())
    ranges = _weight_ranges(ranges)
    # conv, linear, the LSTM's w_ih and w_hh at 4 bits; the embedding table at int8
    assert sorted(ranges.values()) == [(-127, 127)] + [(-8, 7)] * 4, ranges
    four = _weight_ranges(_reference(qt.W4A8Quantizer(embedding_bits=4)))
    assert sorted(four.values()) == [(-8, 7)] * 5


def test_search_and_refine_keep_every_weight_integer_in_minus_8_to_7() -> None:
    quantizer = qt.W4A8Quantizer(
        weight_observer=qt.ObserverKind.SEARCH, activation_observer=qt.ObserverKind.SEARCH
    )
    ref = _reference(quantizer, refine=True)
    rows = ref.meta["quantree_refined"]
    assert sum(r.rounded for r in rows) >= 3, rows  # the linear and the LSTM's two matrices
    # rounding on the 4-bit grid never raises a layer's output error, and lowers some
    assert all(r.error_after <= r.error_before for r in rows), rows
    assert any(r.error_after < 0.98 * r.error_before for r in rows if r.rounded), rows
    seen = 0
    for node in ref.graph.nodes:
        if node.target is DEQUANTIZE_PER_CHANNEL and node.args[-3:] == (-8, 7, torch.int8):
            q = getattr(ref, str(node.args[0].target))
            assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
            assert int(q.min()) == -8 or int(q.max()) == 7  # the grid's ends are used
            seen += 1
    assert seen == 4


def test_lowered_equals_the_reference_on_a_linear_stack() -> None:
    """The int8 kernels compute on the 4-bit values exactly: same integers, same output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = [(torch.randn(4, 16),) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.W4A8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    low = qt.lower(ref, CPU)
    for (x,) in data:
        assert torch.equal(low(x), ref(x))
    # 4 bits: SQNR against float stated low, but not noise (>= 15 dB on this stack)
    assert qt.sqnr(model(data[0][0]), ref(data[0][0])) >= 15.0


def test_embedding_bits_is_checked() -> None:
    with pytest.raises(qt.QuantreeError, match="embedding_bits must be 4 or 8"):
        qt.W4A8Quantizer(embedding_bits=2)
    spec = qt.int4_weight()
    assert spec.range == (-8, 7) and spec.symmetric and spec.axis == 0


def test_cells_mode_gate_weights_are_4_bit_and_lower_exactly() -> None:
    torch.manual_seed(0)
    model = nn.LSTM(16, 32, batch_first=True).eval()
    data = [(torch.randn(2, 6, 16),) for _ in range(4)]
    prepared = qt.prepare(
        qt.capture(model, data[0]), qt.W4A8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    )
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    graphs = [ref, *nested_graphs(ref).values()]
    weights = [
        n.args[-3:]
        for g in graphs
        for n in g.graph.nodes
        if n.target is DEQUANTIZE_PER_CHANNEL and n.args[-1] == torch.int8
    ]
    assert weights == [(-8, 7, torch.int8)] * 2  # the input and the recurrent gate layers
    low = qt.lower(ref, CPU)
    for (x,) in data:
        assert torch.equal(low(x)[0], ref(x)[0])
