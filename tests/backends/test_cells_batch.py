"""A cells-mode loop compiled once runs at any batch size and sequence length, natively."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import batches, leaves

RECIPES = {
    "int8": {},
    "integer-lstm": {"cell_state_dtype": qt.QDtype.INT16, "gate_dtype": qt.QDtype.INT16},
}


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_native_loop_follows_the_batch(recipe):
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, 2, bidirectional=True).eval()
    data = batches((5, 4, 8), n=6)
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS, **recipe)
    ref = qt.quantize(
        model, data[0], data, quantizer=quantizer, progress=False, backend="reference"
    )
    low = qt.lower(ref, CPU)
    assert {type(m).__name__ for m in low.modules() if "CellLoop" in type(m).__name__} == {
        "NativeCellLoop"
    }
    with torch.no_grad():
        for steps, batch in [(5, 4), (9, 8), (3, 1)]:
            x = torch.randn(steps, batch, 8)
            for want, got in zip(leaves(ref(x)), leaves(low(x)), strict=True):
                assert want.shape == got.shape and qt.sqnr(want, got) >= 35.0


def test_native_loop_refuses_a_wrong_width():
    torch.manual_seed(0)
    model = nn.GRU(8, 16).eval()
    data = batches((5, 4, 8), n=3)
    ref = qt.quantize(
        model, data[0], data, quantizer=qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS),
        progress=False, backend="reference",
    )  # fmt: skip
    (loop,) = [m for m in qt.lower(ref, CPU).modules() if type(m).__name__ == "NativeCellLoop"]
    with pytest.raises(ValueError, match="compiled for"):
        loop(torch.randn(5, 4, 9), (torch.zeros(4, 16),))


def test_a16w8_loops_run_natively():
    """int16 inputs to a cell's linears run as the program's two-plane LINEAR16 instruction:
    the loop is native, silent, and equal to the reference."""
    torch.manual_seed(0)
    model = nn.LSTM(8, 16).eval()
    data = batches((5, 2, 8), n=3)
    quantizer = qt.A16W8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    ref = qt.quantize(
        model, data[0], data, quantizer=quantizer, progress=False, backend="reference"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        low = qt.lower(ref, CPU)
    assert any(type(m).__name__ == "NativeCellLoop" for m in low.modules())
    with torch.no_grad():
        assert torch.equal(low(*data[0])[0], ref(*data[0])[0])
