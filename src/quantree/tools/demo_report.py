"""demo_report: the demo's one table, as printed, and its HTML report with plots."""

from __future__ import annotations

import sys
from pathlib import Path

from quantree.tools import demo
from quantree.tools.demo import (
    BATCH,
    DEFAULT_REPORT,
    FLOAT,
    KERNELS,
    SEQ,
    SIMULATED,
    VARIANTS,
    DemoResult,
    DemoRow,
)
from quantree.tools.report import Report, bar_chart, delta_chart

KIND_COLORS = {FLOAT: "#8c8c8c", KERNELS: "#2e8b57", SIMULATED: "#dd8452"}
_KIND_ORDER = {FLOAT: 0, KERNELS: 1, SIMULATED: 2}


def ordered(result: DemoResult) -> list[DemoRow]:
    """Rows grouped by how they run: float, then int8 kernels, then simulations."""
    return sorted(result.rows, key=lambda r: _KIND_ORDER.get(r.kind, 3))


def table_lines(result: DemoResult) -> list[str]:
    """The demo's one table, as printed."""
    base = result.rows[0]
    dynamic = next((r for r in result.rows if r.variant == "torch dynamic int8"), base)
    rows = ordered(result)
    width = max(len(r.variant) for r in rows)
    kw = max(len(r.kind) for r in rows)
    header = (
        f"{'variant':<{width}}  {'runs as':<{kw}}  {'bits/char':>9}  {'vs float':>8}  "
        f"{'logits SQNR':>11}  {'latency':>10}  {'vs float':>8}  {'vs dynamic':>10}  "
        f"{'size':>8}  {'calibrate':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        delta = (r.bits_per_char / base.bits_per_char - 1.0) * 100.0
        db = "-" if r.variant == "float" else f"{r.logits_sqnr_db:.1f} dB"
        cal = f"{r.calibrate_s:.1f} s" if r.calibrate_s else "-"
        lines.append(
            f"{r.variant:<{width}}  {r.kind:<{kw}}  {r.bits_per_char:>9.4f}  {delta:>+7.2f}%  "
            f"{db:>11}  {r.latency_ms:>7.1f} ms  {r.latency_ms / base.latency_ms:>7.2f}x  "
            f"{r.latency_ms / dynamic.latency_ms:>9.2f}x  {r.size_bytes / 1e6:>5.2f} MB  {cal:>9}"
        )
    return lines


def describe(result: DemoResult) -> str:
    return (
        f"bundled char-level LSTM LM (stdlib text); bits/char on {result.eval_chars:,} "
        f"validation chars, logits SQNR on {result.compare_batches} batch(es) of {BATCH}x{SEQ} "
        "validation windows, latency = median "
        f"forward of {BATCH}x{SEQ} chars on 1 thread, calibration on "
        f"{result.calibration_batches} batches of {BATCH}x{SEQ}. "
        f"'{SIMULATED}' runs the reference graph (float ops between quantize and dequantize): "
        f"its accuracy is the int8 model's, its latency is not; '{KERNELS}' runs integer code."
    )


def _label(row: DemoRow) -> str:
    return f"{row.variant} [{row.kind}]"


def write_report(result: DemoResult, path: str | Path) -> Path:
    """The demo's HTML report: the table, latency and size bars, per-tensor SQNR per variant."""
    report = Report("quantree demo")
    report.paragraph(describe(result))
    report.preformatted("\n".join(table_lines(result)))
    for name, message in result.failures.items():
        report.paragraph(f"not in the table: {name} failed ({message})")
    rows = ordered(result)
    base = result.rows[0]
    labels = [_label(r) for r in rows]
    colors = [KIND_COLORS.get(r.kind, "#4c72b0") for r in rows]
    kinds = {r.kind for r in rows}
    legend = {k: c for k, c in KIND_COLORS.items() if k in kinds}
    report.heading("Latency")
    report.image(
        bar_chart(
            labels,
            [r.latency_ms for r in rows],
            "forward latency, 1 thread (log scale; dashed line: float)",
            "ms per forward of 16x128 chars (lower is better)",
            "{:.1f} ms",
            colors=colors,
            legend=legend,
            log=True,
            reference=base.latency_ms,
            texts=[
                f"{r.latency_ms:.1f} ms ({r.latency_ms / base.latency_ms:.2f}x float)" for r in rows
            ],
        ),
        "latency per variant",
    )
    report.heading("Accuracy and size")
    quantized = [r for r in rows if r.kind != FLOAT]
    report.image(
        delta_chart(
            [_label(r) for r in quantized],
            [(r.bits_per_char / base.bits_per_char - 1.0) * 100.0 for r in quantized],
            f"bits per character against float ({base.bits_per_char:.4f}); lower is better",
            "change in validation bits/char against float (%)",
            "{:+.2f}%",
            colors=[KIND_COLORS.get(r.kind, "#4c72b0") for r in quantized],
            legend={k: c for k, c in legend.items() if k != FLOAT},
        ),
        "change in bits per character against float per variant",
    )
    report.image(
        bar_chart(
            labels,
            [r.size_bytes / 1e6 for r in rows],
            "model size",
            "MB",
            "{:.2f} MB",
            colors=colors,
            legend=legend,
        ),
        "model size per variant",
    )
    for name, text in result.summaries.items():
        native = next((line for line in text.splitlines() if line.startswith("run natively")), "")
        report.details(f"What is quantized: {name} ({native.split(' (')[0]})", text)
    report.time_steps(result.comparisons)
    for name, comparison in result.comparisons.items():
        report.comparison(comparison, f"{name}: per-tensor SQNR against float")
    return report.write(path)


def main(
    calibration_batches: int = 50,
    eval_chars: int = 100_000,
    report_path: str | Path = DEFAULT_REPORT,
    *,
    all_variants: bool = False,
) -> DemoResult:
    """What ``quantree demo`` runs: measure, print the table, write the report.

    Progress bars are drawn only when stderr is a terminal.
    """
    variants = VARIANTS if all_variants else demo.DEFAULT_VARIANTS
    result = demo.run_demo(
        calibration_batches, eval_chars, variants=variants, progress=sys.stderr.isatty()
    )
    print()
    print(describe(result))
    print("\n".join(table_lines(result)))
    for name, message in result.failures.items():
        print(f"not in the table: {name} failed ({message})")
    if not all_variants:
        print("(quantree demo --all adds the cells-mode and a16w8 recipes; several minutes)")
    written = write_report(result, report_path)
    print(f"\nreport: {written}")
    print(f"demo took {result.seconds:.0f} s")
    return result
