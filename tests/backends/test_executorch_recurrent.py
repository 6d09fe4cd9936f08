"""Whole-mode LSTM layers in ExecuTorch: XNNPACK's dynamically quantized int8 linears.

The input projection of all steps is one int8 linear per layer, each step one int8 linear
on ``h``; the gates run in fp32 in XNNPACK. ``h`` is requantized per step on its own range
(the reference keeps it float), so ExecuTorch's output is compared with the reference at
``SQNR_VS_REFERENCE_DB`` and with float no more than ``BAND_DB`` below the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

pytest.importorskip(
    "executorch.exir", reason="ExecuTorch tests need executorch (see docs/deployment-executorch.md)"
)

import quantree as qt
from quantree.backends.executorch import lower_executorch, run_executorch
from quantree.backends.executorch.dialect import DEQUANTIZE_DYNAMIC, to_xnnpack_dialect

from support import batches

SQNR_VS_REFERENCE_DB = 25.0
BAND_DB = 1.0
STEPS = 5


class Tagger(nn.Module):
    """A 2-layer batch-first LSTM whose output sequence and final states are all read."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(12, 32, 2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, (h, c) = self.lstm(x)
        return self.head(out), h, c


def _reference() -> tuple[nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = Tagger().eval()
    data = batches((1, STEPS, 12), n=8)
    return model, qt.quantize(
        model, data[0], data, progress=False, dynamic_batch=False, backend="reference"
    )


def test_lstm_becomes_one_int8_projection_and_one_int8_step_product_per_step() -> None:
    _, ref = _reference()
    gm = to_xnnpack_dialect(ref)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.lstm.input not in targets
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    dynamic = [n for n in linears if n.args[0].target == DEQUANTIZE_DYNAMIC]
    assert len(dynamic) == 2 * (1 + STEPS)  # per layer: the projection, then one per step
    assert all(n.args[1].args[-1] == torch.int8 for n in dynamic)  # int8 weights, not float


def test_lstm_runs_in_xnnpack_close_to_the_reference() -> None:
    model, ref = _reference()
    (example,) = batches((1, STEPS, 12), n=1)
    lowered = lower_executorch(ref, example)
    left = lowered.delegation.portable_ops
    assert not [op for op in left if "linear" in op or "lstm" in op or "mm" in op], left
    for (x,) in batches((1, STEPS, 12), n=3, seed=4):
        got = run_executorch(lowered.buffer, (x,))
        want, floats = tree_leaves(ref(x)), tree_leaves(model(x))
        assert len(got) == len(want) == 3  # out, h_n, c_n
        for g, w, f in zip(got, want, floats, strict=True):
            assert qt.sqnr(w, g) >= SQNR_VS_REFERENCE_DB
            assert qt.sqnr(f, g) >= qt.sqnr(f, w) - BAND_DB


class Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(6, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


def test_a_gru_runs_in_fp32_named_in_a_warning_and_close_to_the_reference() -> None:
    torch.manual_seed(0)
    data = batches((1, 3, 6), n=6)
    ref = qt.quantize(
        Gru().eval(), data[0], data, progress=False, dynamic_batch=False, backend="reference"
    )
    with pytest.warns(qt.QuantreeWarning, match="recurrent layer"):
        lowered = lower_executorch(ref, data[0])
    for (x,) in batches((1, 3, 6), n=2, seed=5):
        (got,) = run_executorch(lowered.buffer, (x,))
        assert qt.sqnr(tree_leaves(ref(x))[0], got) >= SQNR_VS_REFERENCE_DB


def test_cells_mode_is_refused_with_the_fix_and_whole_mode_exports() -> None:
    torch.manual_seed(0)
    model = Gru().eval()
    data = batches((1, 3, 6), n=4)
    cells = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    ref = qt.quantize(
        model,
        data[0],
        data,
        quantizer=cells,
        progress=False,
        dynamic_batch=False,
        backend="reference",
    )
    with pytest.raises(qt.QuantreeError, match=r"RecurrentMode\.WHOLE"):
        lower_executorch(ref, data[0])
    whole = qt.Int8Quantizer(recurrent=qt.RecurrentMode.WHOLE)
    ref = qt.quantize(
        model,
        data[0],
        data,
        quantizer=whole,
        progress=False,
        dynamic_batch=False,
        backend="reference",
    )
    with pytest.warns(qt.QuantreeWarning, match="recurrent layer"):
        assert lower_executorch(ref, data[0]).delegation.delegate_calls >= 1
