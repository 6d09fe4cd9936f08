"""report: a self-contained HTML file with tables and PNG plots embedded inline.

Plots are drawn with matplotlib's Agg canvas directly (no pyplot, no global backend switch),
encoded as PNG and inlined as base64 ``data:`` URIs, so the report is one file that opens
anywhere without a server or network.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from quantree.tools.compare import Comparison, RowKind

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_KIND_COLORS = {RowKind.VALUE: "#4c72b0", RowKind.WEIGHT: "#dd8452", RowKind.OUTPUT: "#55a868"}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
summary { cursor: pointer; margin: 0.5em 0; font-weight: 600; }
"""


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def sqnr_chart(comparison: Comparison, title: str = "per-tensor SQNR", limit: int = 40) -> bytes:
    """Horizontal bars of SQNR per tensor, worst at the top; exact tensors drawn as 'exact'."""
    rows = list(comparison.rows[:limit])
    finite = [r.sqnr_db for r in rows if math.isfinite(r.sqnr_db)]
    cap = max(finite, default=60.0) + 10.0
    fig = Figure(figsize=(8.0, 0.8 + 0.28 * max(len(rows), 1)))
    ax = fig.add_subplot()
    values = [r.sqnr_db if math.isfinite(r.sqnr_db) else cap for r in rows]
    colors = [_KIND_COLORS[r.kind] for r in rows]
    positions = list(range(len(rows)))
    ax.barh(positions, values, color=colors)
    ax.set_yticks(positions, [r.name for r in rows], fontsize=8)
    ax.invert_yaxis()
    for y, r in zip(positions, rows, strict=True):
        text = "exact" if not math.isfinite(r.sqnr_db) else f"{r.sqnr_db:.1f}"
        ax.text(min(values[y], cap), y, f" {text}", va="center", fontsize=7)
    ax.set_xlabel("SQNR (dB), higher is better")
    ax.set_xlim(0, cap * 1.12)
    ax.set_title(title)
    handles = [ax.bar([0], [0], color=c, label=k.value) for k, c in _KIND_COLORS.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    return _png(fig)


def _legend_below(ax: Any, legend: Mapping[str, str]) -> None:
    """The colour key in one row under the axis, where it covers no bar or value."""
    handles = [Patch(color=c, label=k) for k, c in legend.items()]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    title: str,
    xlabel: str,
    fmt: str = "{:.1f}",
    *,
    colors: Sequence[str] | None = None,
    legend: Mapping[str, str] | None = None,
    log: bool = False,
    reference: float | None = None,
    texts: Sequence[str] | None = None,
) -> bytes:
    """Horizontal bars, one per label (latency per variant, model size, ...).

    ``log`` draws the axis logarithmically (values a hundred times apart stay readable);
    ``reference`` draws a dashed vertical line (the float model's value); ``legend`` maps a
    label to a colour for the key; ``texts`` replaces the value written after each bar.
    """
    fig = Figure(figsize=(8.0, 1.2 + 0.4 * max(len(labels), 1)))
    ax = fig.add_subplot()
    positions = list(range(len(labels)))
    ax.barh(positions, list(values), color=list(colors) if colors else "#4c72b0")
    ax.set_yticks(positions, list(labels), fontsize=9)
    ax.invert_yaxis()
    positive = [v for v in values if v > 0]
    top = max(values, default=1.0)
    written = list(texts) if texts is not None else [fmt.format(v) for v in values]
    for y, v, text in zip(positions, values, written, strict=True):
        ax.text(v, y, " " + text, va="center", fontsize=8, backgroundcolor="white")
    if log and positive:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 2.0, max(positive) * 4.0)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_xlim(0, top * 1.25 if top > 0 else 1.0)
    if reference is not None:
        ax.axvline(reference, color="#555555", linestyle="--", linewidth=1)
    if legend:
        _legend_below(ax, legend)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return _png(fig)


def delta_chart(
    labels: Sequence[str],
    values: Sequence[float],
    title: str,
    xlabel: str,
    fmt: str = "{:+.2f}",
    *,
    colors: Sequence[str] | None = None,
    legend: Mapping[str, str] | None = None,
) -> bytes:
    """Horizontal bars of a change against a baseline, drawn from zero in both directions
    (the change in bits per character against float), so small differences are visible."""
    fig = Figure(figsize=(8.0, 1.2 + 0.4 * max(len(labels), 1)))
    ax = fig.add_subplot()
    positions = list(range(len(labels)))
    ax.barh(positions, list(values), color=list(colors) if colors else "#4c72b0")
    ax.set_yticks(positions, list(labels), fontsize=9)
    ax.invert_yaxis()
    ax.axvline(0.0, color="#333333", linewidth=1)
    span = max((abs(v) for v in values), default=0.0) or 1.0
    ax.set_xlim(-span * 1.5, span * 1.5)
    for y, v in zip(positions, values, strict=True):
        ax.text(v, y, f" {fmt.format(v)} " , va="center", ha="left" if v >= 0 else "right",
                fontsize=8)  # fmt: skip
    if legend:
        _legend_below(ax, legend)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return _png(fig)


def _is_number(cell: object) -> bool:
    if isinstance(cell, int | float):
        return True
    text = str(cell)
    if text in ("exact", "-", "inf", "nan"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


class Report:
    """Sections appended in order, written as one HTML file."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []

    def heading(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def paragraph(self, text: str) -> None:
        self.parts.append(f"<p>{html.escape(text)}</p>")

    def preformatted(self, text: str) -> None:
        self.parts.append(f"<pre>{html.escape(text)}</pre>")

    def details(self, summary: str, text: str) -> None:
        """Preformatted text folded under a one-line summary (a long inspection)."""
        self.parts.append(
            f"<details><summary>{html.escape(summary)}</summary>"
            f"<pre>{html.escape(text)}</pre></details>"
        )

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """Text columns left-aligned, number columns (every cell a number) right-aligned."""
        numeric = [
            bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(headers))
        ]
        cls = [' class="num"' if n else "" for n in numeric]
        head = "".join(
            f"<th{c}>{html.escape(str(h))}</th>" for h, c in zip(headers, cls, strict=True)
        )
        body = "".join(
            "<tr>"
            + "".join(f"<td{c}>{html.escape(str(v))}</td>" for v, c in zip(row, cls, strict=True))
            + "</tr>"
            for row in rows
        )
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def image(self, png: bytes, alt: str) -> None:
        if not png.startswith(PNG_SIGNATURE):
            raise ValueError(f"{alt}: not a PNG image")
        data = base64.b64encode(png).decode("ascii")
        self.parts.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')

    def comparison(self, comparison: Comparison, title: str) -> None:
        """A compare() result: its chart and its full table."""
        self.heading(title)
        self.image(sqnr_chart(comparison, title), f"{title}: SQNR per tensor")
        self.table(
            ["tensor", "op", "quantized as", "shape", "SQNR dB"],
            [
                (
                    r.name,
                    r.op,
                    r.quantization,
                    "x".join(map(str, r.shape)),
                    "exact" if not math.isfinite(r.sqnr_db) else f"{r.sqnr_db:.1f}",
                )
                for r in comparison.rows
            ],
        )

    def html(self) -> str:
        title = html.escape(self.title)
        body = "\n".join(self.parts)
        return (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}'
            f"</title><style>{_STYLE}</style></head>\n<body><h1>{title}</h1>\n{body}\n"
            "</body></html>\n"
        )

    def write(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.html(), encoding="utf-8")
        return target.resolve()


def embedded_pngs(page: str) -> list[bytes]:
    """The PNG images inlined in a report's HTML (used to check a written report)."""
    marker = "data:image/png;base64,"
    images = []
    start = page.find(marker)
    while start >= 0:
        end = page.find('"', start)
        images.append(base64.b64decode(page[start + len(marker) : end]))
        start = page.find(marker, end)
    return images
