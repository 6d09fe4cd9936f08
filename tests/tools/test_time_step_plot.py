"""Error along the sequence: per-step SQNR of each recurrent layer's output and, in cells
mode, of each state, drawn as one SVG chart per layer in the report."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.tools.report import Report, downsampled, embedded_svgs, sqnr_bars, step_lines


class TwoLayers(nn.Module):
    """A bidirectional 2-layer LSTM encoder, then a GRU decoder: two recurrent layers."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.LSTM(6, 8, num_layers=2, batch_first=True, bidirectional=True)
        self.dec = nn.GRU(16, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.enc(x)
        z, _ = self.dec(y.transpose(0, 1))
        return self.fc(z)


STEPS = 120
CELLS = qt.RecurrentMode.CELLS


@pytest.fixture(scope="module")
def comparisons() -> dict[str, qt.Comparison]:
    torch.manual_seed(0)
    model = TwoLayers().eval()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, STEPS, 6, generator=g),) for _ in range(3)]
    gm = qt.capture(model, data[0])
    result = {}
    for mode in qt.RecurrentMode:
        prepared = qt.prepare(gm, qt.Int8Quantizer(recurrent=mode))
        qt.calibrate(prepared, data, progress=False)
        result[mode.value] = qt.compare(prepared, qt.convert(prepared), data[:1])
    return result


def test_cells_mode_states_get_a_series_per_layer_and_direction(comparisons) -> None:
    """Before: compared against the prepared model, a cells-mode layer had no per-step rows
    (its node is the loop module, not aten.lstm) and states were one number per run."""
    cells = comparisons["cells"]
    series = {(r.layer, r.series) for r in cells.rows if r.steps}
    loops = ("l0", "l0_reverse", "l1", "l1_reverse")
    expected = {("enc", f"{k} {loop}") for k in ("hidden", "cell") for loop in loops}
    assert expected | {("enc", "output"), ("dec", "output")} <= series
    for row in cells.rows:
        if row.steps:
            assert len(row.steps) == STEPS, row.name
            assert min(row.steps) >= 15.0, row.name  # int8 everywhere: measured 24-45 dB
    whole = comparisons["whole"]
    assert {(r.layer, r.series) for r in whole.rows if r.steps} == {
        ("enc", "output l0"),  # the stacked encoder, split per layer at prepare
        ("enc", "output"),
        ("dec", "output"),
    }


@pytest.mark.parametrize("series, half", [("hidden l0", 0), ("hidden l0_reverse", 1)])
def test_a_state_series_is_in_time_order(series: str, half: int) -> None:
    """A reverse body's first call is the last time step: each direction's hidden-state
    series is the per-step SQNR of its half of the model's output, step for step."""
    torch.manual_seed(0)
    model = nn.GRU(4, 5, bidirectional=True).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 2, 4, generator=g),)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer(recurrent=CELLS))
    qt.calibrate(prepared, data, progress=False)
    converted = qt.convert(prepared)
    row = next(r for r in qt.compare(prepared, converted, data).rows if r.series == series)
    want, got = prepared(*data[0])[0], converted(*data[0])[0]
    part = slice(0, 5) if half == 0 else slice(5, 10)
    for t in range(12):
        expected = qt.sqnr(want[t, :, part], got[t, :, part])
        assert row.steps[t] == pytest.approx(expected, abs=0.05), (t, row.steps)


def test_downsampling_keeps_a_dip_and_bounds_the_points() -> None:
    steps = [40.0] * 1000
    steps[517] = 10.0  # one bad step
    xs, ys, k = downsampled(steps, points=100)
    assert len(xs) == len(ys) == 100 and k == 10
    assert min(ys) < 21.0  # the bin holding the dip: 10 dB in 1 of 10 steps -> 20 dB
    assert ys.index(min(ys)) == 51 and all(
        abs(y - 40.0) < 1e-9 for i, y in enumerate(ys) if i != 51
    )
    assert (
        downsampled([math.inf, math.inf])[1][0] != downsampled([math.inf, math.inf])[1][0]
    )  # NaN gap


def test_report_has_one_readable_chart_per_recurrent_layer(comparisons) -> None:
    report = Report("steps")
    report.time_steps(comparisons)
    page = report.html()
    charts = embedded_svgs(page)
    assert len(charts) == 2  # enc and dec
    for chart, layer in zip(charts, ("enc", "dec"), strict=True):
        root = ET.fromstring(chart)  # well-formed SVG
        assert root.tag.endswith("svg")
        texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
        assert f"{layer}: SQNR per time step" in texts
        assert "time step (each point pools 2 steps)" in texts  # 120 steps -> <= 100 points
        assert "SQNR (dB)" in texts
        assert "whole" in texts and "cells" in texts  # the legend: each variant
    enc_texts = " ".join(t.text or "" for t in ET.fromstring(charts[0]).iter())
    assert "hidden l1_reverse" in enc_texts and "cell l0" in enc_texts
    assert "output" in enc_texts  # a panel per variant, a line per series
    # the table beside the charts: every series' first, last and worst step
    # whole: layer 0's output and the encoder's; cells: the output and 8 states
    assert page.count("<td>enc</td>") == 2 + 1 + 8 and "at t" in page


def test_a_one_layer_loops_hidden_state_is_not_drawn_twice(comparisons) -> None:
    lines = step_lines({"cells": comparisons["cells"]})
    assert [series for _, series, _ in lines["dec"]] == ["output"]  # hidden l0 == output


def test_no_recurrent_layer_no_section() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    data = [(torch.randn(3, 4),)]
    comparison = qt.compare(
        model, qt.quantize(model, data[0], data, progress=False, backend="reference"), data
    )
    report = Report("none")
    report.time_steps({"int8": comparison})
    assert "Error along the sequence" not in report.html()


def test_per_tensor_bars_stop_where_the_differences_are() -> None:
    """Before: biases at ~150 dB set the axis, and 30-45 dB activations were slivers."""
    values, end = sqnr_bars([28.6, 35.0, 44.3, 146.9, math.inf])
    assert end == 90.0
    assert values == [28.6, 35.0, 44.3, 90.0, 90.0]
    assert sqnr_bars([30.0, 41.0])[1] == 51.0  # all low: 10 dB past the top
