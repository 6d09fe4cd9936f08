"""demo_report: the demo's one table, as printed, and its HTML report with plots."""

from __future__ import annotations

from pathlib import Path

from quantree.tools import demo
from quantree.tools.demo import BATCH, DEFAULT_REPORT, SEQ, DemoResult
from quantree.tools.report import Report, bar_chart


def table_lines(result: DemoResult) -> list[str]:
    """The demo's one table, as printed."""
    base = result.rows[0]
    dynamic = next((r for r in result.rows if r.variant == "torch dynamic int8"), base)
    width = max(len(r.variant) for r in result.rows)
    header = (
        f"{'variant':<{width}}  {'bits/char':>9}  {'vs float':>8}  {'logits SQNR':>11}  "
        f"{'latency':>10}  {'vs float':>8}  {'vs dynamic':>10}  {'size':>8}  {'calibrate':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in result.rows:
        delta = (r.bits_per_char / base.bits_per_char - 1.0) * 100.0
        db = "-" if r.variant == "float" else f"{r.logits_sqnr_db:.1f} dB"
        cal = f"{r.calibrate_s:.1f} s" if r.calibrate_s else "-"
        lines.append(
            f"{r.variant:<{width}}  {r.bits_per_char:>9.4f}  {delta:>+7.2f}%  {db:>11}  "
            f"{r.latency_ms:>7.1f} ms  {r.latency_ms / base.latency_ms:>7.2f}x  "
            f"{r.latency_ms / dynamic.latency_ms:>9.2f}x  {r.size_bytes / 1e6:>5.2f} MB  {cal:>9}"
        )
    return lines


def describe(result: DemoResult) -> str:
    return (
        f"bundled char-level LSTM LM (stdlib text); bits/char on {result.eval_chars:,} "
        f"validation chars, logits SQNR on {result.compare_batches} batch(es) of {BATCH}x{SEQ} "
        "validation windows, latency = median "
        f"forward of {BATCH}x{SEQ} chars on 1 thread, calibration on "
        f"{result.calibration_batches} batches of {BATCH}x{SEQ}"
    )


def write_report(result: DemoResult, path: str | Path) -> Path:
    """The demo's HTML report: the table, latency and size bars, per-tensor SQNR per variant."""
    report = Report("quantree demo")
    report.paragraph(describe(result))
    report.preformatted("\n".join(table_lines(result)))
    for name, message in result.failures.items():
        report.paragraph(f"not in the table: {name} failed ({message})")
    names = [r.variant for r in result.rows]
    report.heading("Latency")
    report.image(
        bar_chart(names, [r.latency_ms for r in result.rows], "forward latency (1 thread)", "ms"),
        "latency per variant",
    )
    report.heading("Accuracy and size")
    report.image(
        bar_chart(
            names,
            [r.bits_per_char for r in result.rows],
            "validation bits per character (lower is better)",
            "bits/char",
            "{:.4f}",
        ),
        "bits per character per variant",
    )
    report.image(
        bar_chart(names, [r.size_bytes / 1e6 for r in result.rows], "model size", "MB", "{:.2f}"),
        "model size per variant",
    )
    for name, comparison in result.comparisons.items():
        report.comparison(comparison, f"{name}: per-tensor SQNR against float")
    return report.write(path)


def main(
    calibration_batches: int = 50,
    eval_chars: int = 100_000,
    report_path: str | Path = DEFAULT_REPORT,
) -> DemoResult:
    """What ``quantree demo`` runs: measure, print the table, write the report."""
    result = demo.run_demo(calibration_batches, eval_chars)
    print()
    print(describe(result))
    print("\n".join(table_lines(result)))
    for name, message in result.failures.items():
        print(f"not in the table: {name} failed ({message})")
    written = write_report(result, report_path)
    print(f"\nreport: {written}")
    print(f"demo took {result.seconds:.0f} s")
    return result
