"""The numeric debugger on a speech-style model: batch norm folded, CPU-lowered kernels."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.tools.compare import RowKind


class Speech(nn.Module):
    """Conv1d + BatchNorm -> Conv1d -> 2-layer bidirectional GRU -> Linear -> log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv1d(20, 32, 5, padding=2), nn.BatchNorm1d(32)
        self.conv2 = nn.Conv1d(32, 32, 3, padding=1)
        self.gru = nn.GRU(32, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(48, 29)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(feats)))
        y, _ = self.gru(torch.relu(self.conv2(x)).transpose(1, 2))
        return torch.log_softmax(self.fc(y), -1)


@pytest.fixture(scope="module")
def speech() -> tuple[nn.Module, torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = Speech().train()
    with torch.no_grad():
        for _ in range(10):  # batch norm statistics away from (0, 1)
            model(torch.randn(8, 20, 50) * 2 + 0.5)
    model.eval()
    data = [(torch.randn(4, 20, 50) * 2 + 0.5,) for _ in range(12)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # log_softmax has a rule now
        ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    return model, ref, data


LAYERS = ("aten.conv1d", "aten.linear", "aten.gru", "aten.relu", "aten.transpose")
WEIGHTED = ("conv1d", "conv1d_1", "gru_l0", "gru_l1", "linear")  # conv, GRU layers, linear


def _prepared_float(model: nn.Module, data: list[tuple[torch.Tensor]]) -> torch.fx.GraphModule:
    """What prepare made of the model, computing float (observers return their input): the
    stacked GRU is one call per layer there, as in the quantized graph, so each layer has a
    float counterpart to compare with (a plain capture holds the stacked call only)."""
    return qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())


def _check_worst_is_a_layer(comparison: qt.Comparison) -> None:
    """The worst row is a layer's activation, within 3 dB of the logits' SQNR.

    The logits (``linear``, what log_softmax reads) stand for the output: log_softmax
    subtracts each row's log-normaliser, a large common offset that counts as signal, so
    the model output reads ~27 dB higher (measured 67 dB against 39 dB for the logits).
    Before the fix the worst rows were a folded conv's bias at -30 dB and the conv at 1.7 dB.
    """
    worst = comparison.rows[0]
    logits = comparison.row("linear")
    (output,) = comparison.outputs
    assert any(worst.op.startswith(op) for op in LAYERS), worst
    assert worst.kind is RowKind.VALUE, worst
    assert worst.sqnr_db >= logits.sqnr_db - 3.0, comparison.render(5)
    assert output.sqnr_db >= logits.sqnr_db, comparison.render(5)
    assert all(r.sqnr_db >= 25.0 for r in comparison.rows), comparison.render(5)


def test_folded_batch_norm_is_compared_with_conv_plus_batch_norm(speech) -> None:
    """Before: conv1.bias at -30 dB and conv1d at 1.7 dB (float conv vs folded conv)."""
    model, ref, data = speech
    comparison = qt.compare(_prepared_float(model, data), ref, data[:3])
    _check_worst_is_a_layer(comparison)
    names = {r.name for r in comparison.rows}
    assert "batch_norm" not in names  # folded: the conv row means conv + batch norm
    assert set(WEIGHTED) <= {r.node for r in comparison.rows}


def test_cpu_lowered_model_has_a_row_per_kernel(speech) -> None:
    """Before: four rows, all 'quantized as float'; then conv+relu rows named 'relu'."""
    model, ref, data = speech
    comparison = qt.compare(_prepared_float(model, data), qt.lower(ref, CPU), data[:3])
    _check_worst_is_a_layer(comparison)
    kernels = {r.name: r for r in comparison.rows if r.quantization == "int8 kernel"}
    # every conv, linear and recurrent layer has its own row, named after the layer
    # the last layer of the split GRU holds the user's layer's output, and is named so
    expected = {"conv1d (+relu)", "conv1d_1 (+relu)", "linear", "gru_l0[0]", "gru_l1[0] (gru[0])"}
    assert expected <= set(kernels)
    assert kernels["conv1d (+relu)"].op == "aten.conv1d.default"
    assert not any(r.name.startswith("relu") for r in comparison.rows)
    # a fused kernel holds relu's Value: its SQNR is the reference's relu row's
    rows = qt.compare(_prepared_float(model, data), ref, data[:3]).rows
    reference = {r.node: r.sqnr_db for r in rows if r.kind is RowKind.VALUE}
    for row in kernels.values():
        if row.node in reference:
            assert abs(row.sqnr_db - reference[row.node]) < 3.0, row


@pytest.mark.parametrize("mode", list(qt.RecurrentMode))
def test_recurrent_outputs_get_an_sqnr_per_time_step(mode: qt.RecurrentMode) -> None:
    torch.manual_seed(0)
    model = nn.LSTM(12, 16, batch_first=False).eval()
    data = [(torch.randn(30, 3, 12),) for _ in range(6)]
    quantizer = qt.Int8Quantizer(recurrent=mode)
    ref = qt.quantize(
        model, data[0], data, quantizer=quantizer, progress=False, backend="reference"
    )
    comparison = qt.compare(model, ref, data[:2])
    row = comparison.row("lstm[0]")
    assert len(row.steps) == 30  # time is axis 0 here
    overall = row.sqnr_db
    assert min(row.steps) <= overall + 1e-9 <= max(row.steps) + 1e-9  # the mean lies within
    assert min(row.steps) >= 20.0  # int8, one layer: measured 28-40 dB per step
    assert "per-step SQNR" in comparison.render()
    assert not comparison.row("lstm[1]").steps  # a state is one step, not a sequence
