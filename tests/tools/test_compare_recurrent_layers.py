"""compare finds stacked recurrent layers however prepare rewrote them, for any pairing.

Prepare splits a stacked LSTM/GRU into one call per layer (whole mode) or replaces it by cell
loops (cells mode), so the user's ``lstm`` node is gone from the quantized graph. Before the
fix, ``qt.compare(model, qmodel, data)`` (the README's form) had no row at all for an LSTM
of two or more layers in whole mode, and said nothing about it.
"""

from __future__ import annotations

import math

import pytest
import torch
from per_op_reference import assert_rows_match, float_graph
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.tools.compare import RowKind

LAYER_FLOOR_DB = 20.0
"""The recurrent rows at int8 on these small random models: measured 30-45 dB."""


class Speech(nn.Module):
    """conv1d -> stacked recurrent layer -> linear; returns the logits and h_n."""

    def __init__(self, kind: str, layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(8, 10, layers, bidirectional=bidirectional, batch_first=True)
        self.fc = nn.Linear(20 if bidirectional else 10, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.rnn(torch.relu(self.conv(x)).transpose(1, 2))
        h = state[0] if isinstance(state, tuple) else state
        return self.fc(out), h


CASES = [("lstm", 2, True), ("gru", 3, False)]


@pytest.fixture(scope="module", params=[(c, m) for c in CASES for m in qt.RecurrentMode],
                ids=lambda p: f"{p[0][0]}{p[0][1]}-{p[1].value}")  # fmt: skip
def quantized(request):
    (kind, layers, bidirectional), mode = request.param
    torch.manual_seed(0)
    model = Speech(kind, layers, bidirectional).eval()
    data = [(torch.randn(3, 6, 7),) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer(recurrent=mode))
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    return model, prepared, ref, qt.lower(ref, CPU), data


@pytest.mark.parametrize("lowered", [False, True], ids=["reference", "cpu"])
def test_the_users_stacked_layer_has_its_rows(quantized, lowered: bool) -> None:
    model, _, ref, low, data = quantized
    qmodel = low if lowered else ref
    comparison = qt.compare(model, qmodel, data[:2])
    rows = {r.name: r for r in comparison.rows}
    op = type(model.rnn).__name__.lower()  # the node is named after the op: lstm, gru
    for leaf in (f"{op}[0]", f"{op}[1]"):  # the output sequence and h_n, both read
        assert leaf in rows, comparison.render()
        assert rows[leaf].module == "rnn" and rows[leaf].kind is RowKind.VALUE
        assert LAYER_FLOOR_DB <= rows[leaf].sqnr_db < math.inf, comparison.render()
    assert len(rows[f"{op}[0]"].steps) == 7  # per time step, as for a single layer
    assert_rows_match(comparison, float_graph(model, data[0]), qmodel, data[:2])


@pytest.mark.parametrize("lowered", [False, True], ids=["reference", "cpu"])
def test_against_the_prepared_model_rows_name_the_users_layer(quantized, lowered) -> None:
    model, prepared, ref, low, data = quantized
    comparison = qt.compare(prepared, low if lowered else ref, data[:2])
    recurrent = [r for r in comparison.rows if r.module == "rnn"]
    assert recurrent, comparison.render()
    names = {r.name for r in recurrent}
    op = type(model.rnn).__name__.lower()
    split = [n for n in names if n.startswith(f"{op}_l")]
    if split:  # whole mode: one call per layer, the last one's output is the user's layer's
        last = model.rnn.num_layers - 1
        assert f"{op}_l{last}[0] ({op}[0])" in names, names
    assert all(r.sqnr_db >= LAYER_FLOOR_DB for r in recurrent), comparison.render()


def test_rows_that_cannot_be_matched_are_listed_with_the_reason(quantized) -> None:
    """Nothing is dropped silently: c_n, unused by the model, is not computed by the lowered
    model; compare says so, and why."""
    model, _, _, low, data = quantized
    comparison = qt.compare(model, low, data[:2])
    names = {r.name for r in comparison.rows}
    for u in comparison.unmatched:
        assert u.reason and u.name not in names
    text = comparison.render()
    if isinstance(model.rnn, nn.LSTM):
        (c_n,) = [u for u in comparison.unmatched if u.name == "lstm[2]"]
        assert "unused by the model" in c_n.reason
        assert "not compared" in text and "lstm[2]" in text.split("not compared")[1]
    # the float model's constants the kernels packed are listed, not silently missing
    assert any("rnn.weight_ih_l0" in u.name for u in comparison.unmatched)


def test_a_model_that_is_not_a_graph_says_only_outputs_are_compared(quantized) -> None:
    model, _, ref, _, data = quantized

    class Wrapped(nn.Module):
        def forward(self, x: torch.Tensor):
            return ref(x)

    comparison = qt.compare(model, Wrapped(), data[:1])
    assert {r.kind for r in comparison.rows} == {RowKind.OUTPUT}
    assert comparison.unmatched and all(
        "not a GraphModule" in u.reason for u in comparison.unmatched
    )


def test_the_html_report_lists_what_was_not_compared(quantized) -> None:
    from quantree.tools.report import Report

    model, _, _, low, data = quantized
    comparison = qt.compare(model, low, data[:1])
    report = Report("t")
    report.comparison(comparison, "per-tensor SQNR")
    page = report.html()
    assert f"{len(comparison.unmatched)} float tensor(s) not compared" in page
    assert all(u.reason.replace("'", "&#x27;") in page for u in comparison.unmatched)
