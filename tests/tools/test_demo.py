"""The demo: one list of variants, one table, an HTML report whose plots open as images."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from quantree.tools import demo, demo_report
from quantree.tools.compare import Comparison, RowKind, TensorRow
from quantree.tools.measure import latencies_ms
from quantree.tools.report import PNG_SIGNATURE, embedded_pngs, embedded_svgs
from quantree_cli import main


def _check_pngs(page: str, tmp_path: Path) -> int:
    images = embedded_pngs(page)
    for i, png in enumerate(images):
        assert png.startswith(PNG_SIGNATURE)
        path = tmp_path / f"plot{i}.png"
        path.write_bytes(png)
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    return len(images)


def _broken() -> demo.Quantizer:
    raise RuntimeError("no such recipe")


def test_variants_are_one_list_with_unique_names() -> None:
    names = [v.name for v in demo.VARIANTS]
    assert len(names) == len(set(names))
    assert names[0] == "int8 whole" and demo.VARIANTS[0].available
    assert not demo.Variant("future", demo.int8_whole, requires=("NoSuchName",)).available
    assert not demo.Variant("future", demo.int8_whole, requires=("nosuchmodule.X",)).available


def test_small_demo_run_table_and_report(tmp_path: Path) -> None:
    messages: list[str] = []
    missing = demo.Variant("needs the future", demo.int8_whole, requires=("NoSuchName",))
    broken = demo.Variant("broken", _broken)
    result = demo.run_demo(
        calibration_batches=3,
        eval_chars=4_000,
        compare_batches=1,
        variants=(missing, broken, demo.VARIANTS[0]),
        progress=False,
        log=messages.append,
    )
    assert [r.variant for r in result.rows] == ["float", "torch dynamic int8", "int8 whole"]
    assert "needs the future: skipped (needs quantree.NoSuchName)" in messages
    assert result.failures == {"broken": "RuntimeError: no such recipe"}
    whole = result.row("int8 whole")
    assert 0.5 < whole.bits_per_char < 4.0
    assert 15.0 < whole.logits_sqnr_db < math.inf
    assert whole.latency_ms > 0 and whole.calibrate_s > 0
    assert whole.size_bytes < result.row("float").size_bytes / 2  # int8 weights
    lines = demo_report.table_lines(result)
    assert "bits/char" in lines[0] and "vs dynamic" in lines[0] and "logits SQNR" in lines[0]
    assert len(lines) == 2 + len(result.rows)
    comparison = result.comparisons["int8 whole"]
    # the stacked LSTM is one call per layer (lstm_l0, lstm_l1), each leaf a row
    layers = {f"lstm_l{i}[{leaf}]" for i in (0, 1) for leaf in (0, 1, 2)} - {"lstm_l1[0]"}
    layers.add("lstm_l1[0] (lstm[0])")  # the last layer's output is the stacked LSTM's
    assert layers <= {r.name for r in comparison.rows}
    written = demo_report.write_report(result, tmp_path / "out" / "report.html")
    page = written.read_text()
    assert "int8 whole: per-tensor SQNR against float" in page
    assert _check_pngs(page, tmp_path) == 4  # latency, bits/char, size, one SQNR chart
    (steps,) = embedded_svgs(page)  # the LSTM's SQNR per time step
    assert "SQNR per time step" in steps and "Error along the sequence" in page
    assert "What is quantized: int8 whole" in page and "simulated (q/dq)" in page


def test_cli_demo_prints_the_table_and_the_report_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    row = TensorRow("linear", "linear", (), RowKind.VALUE, "aten.linear", "int8", (2, 3),
                    100.0, 0.01, 0)  # fmt: skip
    canned = demo.DemoResult(
        rows=[
            demo.DemoRow("float", 1.5, math.inf, 20.0, 4_000_000),
            demo.DemoRow("torch dynamic int8", 1.501, 33.0, 22.0, 1_000_000),
            demo.DemoRow("int8 whole", 1.502, 38.0, 30.0, 1_000_000, 1.2, 3.0),
        ],
        comparisons={"int8 whole": Comparison((row,), 1)},
        calibration_batches=50,
        eval_chars=1000,
    )
    seen: dict[str, object] = {}

    def fake_run_demo(calibration_batches: int, eval_chars: int, **kw: Any) -> demo.DemoResult:
        seen.update(calibration_batches=calibration_batches, eval_chars=eval_chars, **kw)
        return canned

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    report = tmp_path / "r" / "demo.html"
    assert main(["demo", "--calibration-batches", "7", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert seen == {
        "calibration_batches": 7,
        "eval_chars": 100_000,
        "variants": demo.DEFAULT_VARIANTS,
        "progress": False,  # stderr is not a terminal under pytest
    }
    assert "int8 whole" in out and "+0.13%" in out and "38.0 dB" in out
    assert f"report: {report.resolve()}" in out
    assert _check_pngs(report.read_text(), tmp_path) == 4
    assert main(["demo", "--all", "--report", str(report)]) == 0
    assert seen["variants"] == demo.VARIANTS


def test_every_variant_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_demo drops a failing variant's row, so each one is run here: a broken cells or
    CPU-kernel variant must fail CI, not vanish from the table."""
    assert all(v.available for v in demo.VARIANTS), [v.missing for v in demo.VARIANTS]

    def one_timed_call(models: Mapping[str, Callable[..., Any]], args: tuple[Any, ...]):
        return latencies_ms(models, args, rounds=1, min_runs=1, budget_s=0.0)

    monkeypatch.setattr(demo, "latencies_ms", one_timed_call)  # timing is not under test
    result = demo.run_demo(
        calibration_batches=2,
        eval_chars=2_048,  # one evaluation batch of 16 x 128
        compare_batches=1,
        variants=demo.VARIANTS,  # what --all runs
        progress=False,
        log=lambda _: None,
    )
    assert result.failures == {}
    names = [v.name for v in demo.VARIANTS]
    assert [r.variant for r in result.rows] == ["float", "torch dynamic int8", *names]
    float_bpc = result.row("float").bits_per_char
    for name in names:
        row = result.row(name)
        assert abs(row.bits_per_char - float_bpc) < 0.05 * float_bpc, name
        assert 20.0 < row.logits_sqnr_db < math.inf, name
        assert row.latency_ms > 0 and row.size_bytes < result.row("float").size_bytes / 2, name
    assert set(result.comparisons) == set(names)


def test_default_run_is_the_fast_subset_and_every_variant_is_labelled() -> None:
    defaults = demo.DEFAULT_VARIANTS
    assert set(defaults) < set(demo.VARIANTS)
    assert {v.kind for v in defaults} == {demo.SIMULATED, demo.KERNELS}
    assert all(v.kind in (demo.SIMULATED, demo.KERNELS) for v in demo.VARIANTS)
    assert all(v.backend is None for v in defaults if v.kind == demo.SIMULATED)
    # the cells-mode simulations take minutes: only with --all
    assert not any(v.quantizer is demo.integer_lstm and v.backend is None for v in defaults)


def _canned() -> demo.DemoResult:
    return demo.DemoResult(
        rows=[
            demo.DemoRow("float", 1.40, math.inf, 80.0, 3_500_000, kind=demo.FLOAT),
            demo.DemoRow("torch dynamic int8", 1.399, 32.0, 50.0, 900_000, kind=demo.KERNELS),
            demo.DemoRow("int8 whole", 1.401, 37.7, 1000.0, 980_000, 4.0, 5.0),
            demo.DemoRow(
                "int8 whole, CPU kernels", 1.401, 37.7, 38.0, 940_000, 4.0, 5.0, kind=demo.KERNELS
            ),
        ],
        calibration_batches=50,
        eval_chars=1000,
    )


def test_table_labels_each_row_and_groups_kernels_before_simulations() -> None:
    lines = demo_report.table_lines(_canned())
    assert "runs as" in lines[0]
    body = lines[2:]
    assert [line.split("  ")[0].strip() for line in body] == [
        "float", "torch dynamic int8", "int8 whole, CPU kernels", "int8 whole"
    ]  # fmt: skip
    assert demo.SIMULATED in body[3] and demo.KERNELS in body[2] and demo.KERNELS in body[1]


def test_charts_show_differences(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Latency on a log axis (a 1,000 ms simulation does not flatten a 38 ms kernel), and
    bits/char as the change against float, not bars from zero."""
    calls: list[tuple[str, Any, dict[str, Any]]] = []
    real_bar, real_delta = demo_report.bar_chart, demo_report.delta_chart

    def bar(labels: Any, values: Any, title: str, *a: Any, **kw: Any) -> bytes:
        calls.append(("bar", list(values), kw))
        return real_bar(labels, values, title, *a, **kw)

    def delta(labels: Any, values: Any, title: str, *a: Any, **kw: Any) -> bytes:
        calls.append(("delta", list(values), kw))
        return real_delta(labels, values, title, *a, **kw)

    monkeypatch.setattr(demo_report, "bar_chart", bar)
    monkeypatch.setattr(demo_report, "delta_chart", delta)
    page = demo_report.write_report(_canned(), tmp_path / "r.html").read_text()
    latency = calls[0]
    assert latency[0] == "bar" and latency[2]["log"] and latency[2]["reference"] == 80.0
    kind, values, _ = calls[1]
    assert kind == "delta" and len(values) == 3  # no float bar
    assert values[0] < 0 < values[1] and abs(values[1] - 100 * (1.401 / 1.40 - 1)) < 1e-9
    for label in ("int8 whole [simulated (q/dq)]", "int8 whole, CPU kernels [int8 kernels]"):
        assert label in page or demo.SIMULATED in page
    assert _check_pngs(page, tmp_path) == 3


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_timed_call(models: Mapping[str, Callable[..., Any]], args: tuple[Any, ...]):
        return latencies_ms(models, args, rounds=1, min_runs=1, budget_s=0.0)

    monkeypatch.setattr(demo, "latencies_ms", one_timed_call)
    demo.run_demo(
        calibration_batches=2, eval_chars=2_048, compare_batches=1, variants=demo.VARIANTS[:1]
    )
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    assert "calibrating" not in captured.err
