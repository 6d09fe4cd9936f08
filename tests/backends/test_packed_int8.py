"""A packed sequence's rows stay int8 through the sort, the packing, the padding and the
restored order (``lowering_packing``).

Each of those ops copies values, so on the integers it computes exactly what the reference's
dequantize -> op -> quantize onto the same grid computes: the lowered model must equal, bit
for bit, the same model lowered with those rules switched off, and hold no dequantize /
quantize pair around them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu

aten = torch.ops.aten
MOVED = (
    aten.index_select.default,
    aten._pack_padded_sequence.default,
    aten._pad_packed_sequence.default,
)
QUANTIZE = (torch.ops.quantree.quantize.default,)  # a lowered graph's direct calls equal the op
DEQUANTIZE = (torch.ops.quantree.dequantize.default,)


class Unsorted(nn.Module):
    """Packs a batch of unsorted lengths, runs a layer, pads and returns its output."""

    def __init__(self, layer: nn.RNNBase, padding_value: float = 0.0, sort: bool = False):
        super().__init__()
        self.layer, self.padding_value, self.sort = layer, padding_value, sort

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.sort)
        out, _ = self.layer(packed)
        padded, _ = pad_packed_sequence(
            out, batch_first=True, padding_value=self.padding_value, total_length=x.shape[1]
        )
        return padded


def lowered(model: nn.Module, data: list[tuple], mode: qt.RecurrentMode, backend=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        return qt.quantize(
            model, data[0], data, quantizer=qt.Int8Quantizer(recurrent=mode),
            backend=backend or CPU, progress=False,
        )  # fmt: skip


def without_packing_rules(monkeypatch: pytest.MonkeyPatch) -> qt.Backend:
    """The CPU backend as it was: the gathers, pack and pad between dequantize/quantize."""
    for name in ("lower_gather", "lower_packing", "lower_metadata_reads"):
        monkeypatch.setattr(cpu, name, lambda ctx, node: False)
    return cpu.cpu_backend()


def data(lengths: list[int], n: int = 4, seed: int = 1) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(len(lengths), 9, 6, generator=g), torch.tensor(lengths)) for _ in range(n)]


def top_level(model: torch.nn.Module) -> list[fx.Node]:
    return [n for n in model.graph.nodes if n.op == "call_function"]  # type: ignore[union-attr]


LAYERS = {
    "lstm": lambda: nn.LSTM(6, 10, batch_first=True, bidirectional=True),
    "gru-2-layers": lambda: nn.GRU(6, 10, num_layers=2, batch_first=True, bidirectional=True),
}
MODES = {"whole": qt.RecurrentMode.WHOLE, "cells": qt.RecurrentMode.CELLS}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
def test_rows_stay_int8_from_the_input_quantize_to_the_output_dequantize(make, mode):
    torch.manual_seed(0)
    model = Unsorted(make()).eval()
    low = lowered(model, data([5, 9, 2, 7]), mode)
    nodes = top_level(low)
    moved = [n for n in nodes if n.target in MOVED]
    assert sorted(str(n.target) for n in moved) == sorted(
        ["aten.index_select.default"] * 2
        + ["aten._pack_padded_sequence.default", "aten._pad_packed_sequence.default"]
    )
    for node in moved:  # reads integers, and its rows go on as integers
        assert node.args[0].target not in DEQUANTIZE  # type: ignore[union-attr]
        rows = [u for u in node.users if u.args[1] == 0] if node.target in MOVED[1:] else [node]
        assert all(u.target not in QUANTIZE for r in rows for u in r.users)
    # one quantize of the input; whole mode: one dequantize of the output; cells mode
    # also the loops' float rows in (their program quantizes) and out (the pad reads int8)
    quantizes = [n for n in nodes if n.target in QUANTIZE]
    dequantizes = [n for n in nodes if n.target in DEQUANTIZE]
    cells = mode is qt.RecurrentMode.CELLS
    assert (len(quantizes), len(dequantizes)) == ((2, 2) if cells else (1, 1))


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
@pytest.mark.parametrize("padding_value", [0.0, 0.37])
def test_int8_packing_equals_the_dequantized_path_bit_for_bit(
    make, mode, padding_value, monkeypatch
):
    torch.manual_seed(0)
    model = Unsorted(make(), padding_value).eval()
    calib = data([5, 9, 2, 7])
    low = lowered(model, calib, mode)
    before = lowered(model, calib, mode, without_packing_rules(monkeypatch))
    moved = [n for n in top_level(before) if n.target in MOVED]
    assert moved and all(n.args[0].target in DEQUANTIZE for n in moved)  # type: ignore[union-attr]
    held = [*data([3, 9, 9, 1], seed=2), *data([2, 5, 4, 3], seed=3), *data([9, 9, 9, 9], seed=4)]
    with torch.no_grad():
        for args in held:
            got, want = low(*args), before(*args)
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_unsorted_lengths_lower_to_the_graph_of_sorted_ones_plus_the_two_gathers():
    torch.manual_seed(0)
    layer = nn.GRU(6, 10, batch_first=True, bidirectional=True)
    unsorted = lowered(Unsorted(layer).eval(), data([5, 9, 2, 7]), qt.RecurrentMode.WHOLE)
    ordered = lowered(Unsorted(layer, sort=True).eval(), data([9, 7, 5, 2]), qt.RecurrentMode.WHOLE)

    def kinds(model: torch.nn.Module) -> list[str]:
        return sorted(
            str(n.target) for n in top_level(model) if n.target in (*QUANTIZE, *DEQUANTIZE)
        )

    assert kinds(unsorted) == kinds(ordered)


def test_default_zero_state_is_folded_not_made_from_dequantized_rows():
    torch.manual_seed(0)
    model = Unsorted(nn.LSTM(6, 10, batch_first=True)).eval()
    low = lowered(model, data([5, 9, 2, 7]), qt.RecurrentMode.WHOLE)
    factories = (aten.new_zeros.default, aten.zeros.default)
    assert not [n for n in top_level(low) if n.target in factories]
