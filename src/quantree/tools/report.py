"""report: a self-contained HTML file with tables and plots embedded inline.

Over 400 lines: the HTML report's plots and tables in one self-contained writer; the
plots move to their own module when another one is added.

Plots are drawn with matplotlib's canvases directly (no pyplot, no global backend switch):
bar charts as PNG inlined as base64 ``data:`` URIs, line charts of SQNR per time step as
inline SVG (text stays text, lines stay sharp at any zoom). The report is one file that
opens anywhere without a server or network.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from quantree.tools.compare import Comparison, RowKind
from quantree.tools.metrics import sqnr_text

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SQNR_AXIS_DB = 80.0

_KIND_COLORS = {RowKind.VALUE: "#4c72b0", RowKind.WEIGHT: "#dd8452", RowKind.OUTPUT: "#55a868"}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
figure { margin: 0.5em 0; }
figure svg { width: 100%; max-width: 60em; height: auto; display: block; }
summary { cursor: pointer; margin: 0.5em 0; font-weight: 600; }
"""


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def sqnr_bars(sqnrs: Sequence[float]) -> tuple[list[float], float]:
    """Bar lengths and the axis end for SQNRs in dB.

    int32 biases at ~150 dB would squeeze the 20-50 dB rows that matter into slivers, so the
    axis ends 10 dB past the data's top or 80 dB, whichever is lower; longer bars (and exact
    tensors, infinite SQNR) end there and carry their value as text.
    """
    finite = [v for v in sqnrs if math.isfinite(v)]
    cap = min(max(finite, default=60.0), _SQNR_AXIS_DB) + 10.0
    return [min(max(v, 0.0), cap) for v in sqnrs], cap


def sqnr_chart(comparison: Comparison, title: str = "per-tensor SQNR", limit: int = 40) -> bytes:
    """Horizontal bars of SQNR per tensor, worst at the top; exact tensors drawn as 'exact'."""
    rows = list(comparison.rows[:limit])
    values, cap = sqnr_bars([r.sqnr_db for r in rows])
    fig = Figure(figsize=(8.0, 0.8 + 0.28 * max(len(rows), 1)))
    ax = fig.add_subplot()
    colors = [_KIND_COLORS[r.kind] for r in rows]
    positions = list(range(len(rows)))
    ax.barh(positions, values, color=colors)
    ax.set_yticks(positions, [r.name for r in rows], fontsize=8)
    ax.invert_yaxis()
    for y, r in zip(positions, rows, strict=True):
        ax.text(values[y], y, f" {sqnr_text(r.sqnr_db)}", va="center", fontsize=7)
    cut = any(r.sqnr_db > cap for r in rows)
    ax.set_xlabel("SQNR (dB), higher is better" + (f"; bars end at {cap:.0f} dB" if cut else ""))
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


_STEP_STYLES = ("-", "--", ":", "-.")  # one per variant, so equal lines stay visible
_STEP_POINTS = 100
_PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
            "#8c8c8c", "#ccb974", "#64b5cd")  # fmt: skip


def downsampled(
    steps: Sequence[float], points: int = _STEP_POINTS
) -> tuple[list[float], list[float], int]:
    """``(x, y, k)``: at most ``points`` points, each pooling ``k`` consecutive steps.

    A point is the SQNR of the bin's mean noise-to-signal ratio, which the worst steps
    dominate (a dip is not averaged away in dB) and which is smooth enough to read where the
    worst step per bin would draw noise. Exact steps add no noise; an all-exact bin is a gap.
    """
    k = max(1, math.ceil(len(steps) / points))
    xs, ys = [], []
    for start in range(0, len(steps), k):
        ratios = [0.0 if v == math.inf else 10.0 ** (-v / 10.0) for v in steps[start : start + k]]
        mean = sum(ratios) / len(ratios)
        xs.append(start + (len(ratios) - 1) / 2.0)
        ys.append(-10.0 * math.log10(mean) if mean > 0.0 else math.nan)
    return xs, ys, k


def _state_style(series: str, loops: list[str]) -> dict[str, Any]:
    """Output thick and dark; a state coloured by its layer and direction, hidden solid,
    cell dashed (``hidden l0_reverse``)."""
    if series == "output":
        return {"color": "#222222", "linewidth": 2.2, "linestyle": "-"}
    kind, _, loop = series.partition(" ")
    color = _PALETTE[loops.index(loop) % len(_PALETTE)] if loop in loops else _PALETTE[-1]
    return {"color": color, "linewidth": 1.3, "linestyle": "-" if kind == "hidden" else "--"}


def steps_chart(layer: str, lines: Sequence[tuple[str, str, Sequence[float]]]) -> str:
    """An SVG line chart of SQNR against time step for one recurrent layer.

    ``lines`` are ``(variant, series, steps)``. When only outputs are compared, one panel
    holds every variant (a colour and a line style each, so equal lines stay visible);
    when a variant also has states (cells mode), each variant gets its own panel, sharing
    both axes. The y axis spans the data, not zero to the top, so a few dB of error growth
    along the sequence shows.
    """
    variants = list(dict.fromkeys(v for v, _, _ in lines))
    split = any(name != "output" for _, name, _ in lines) and len(variants) > 1
    panels = [[line for line in lines if line[0] == v] for v in variants] if split else [lines]
    loops = sorted({s.partition(" ")[2] for _, s, _ in lines if s != "output"})
    height = 0.9 + 2.6 * len(panels)
    fig = Figure(figsize=(9.0, height))
    # fixed margins (no tight bounding box): every layer's chart has the same plot area,
    # whatever its legend holds; the legend sits in the right 22%
    fig.subplots_adjust(left=0.08, right=0.76, top=1 - 0.55 / height, bottom=0.55 / height,
                        hspace=0.3)  # fmt: skip
    axes = fig.subplots(len(panels), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    k = 1
    values: list[float] = []
    for ax, panel in zip(axes, panels, strict=True):
        for variant, name, steps in panel:
            xs, ys, k = downsampled(steps)
            values.extend(y for y in ys if math.isfinite(y))
            if len(variants) > 1 and not split:
                i = variants.index(variant)
                style = {"color": _PALETTE[i % len(_PALETTE)], "linewidth": 1.8,
                         "linestyle": _STEP_STYLES[i % len(_STEP_STYLES)]}  # fmt: skip
                label = variant
            else:
                style, label = _state_style(name, loops), name
            ax.plot(xs, ys, label=label, **style)
        ax.grid(True, color="#e0e0e0", linewidth=0.8)
        ax.set_ylabel("SQNR (dB)")
        if split:
            ax.set_title(panel[0][0], fontsize=9, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if values:
        low, high = min(values), max(values)
        pad = max(1.0, 0.08 * (high - low))
        axes[0].set_ylim(low - pad, high + pad)
    longest = max((len(s) for _, _, s in lines), default=1)
    axes[0].set_xlim(0, max(longest - 1, 1))
    pooled = f" (each point pools {k} steps)" if k > 1 else ""
    axes[-1].set_xlabel(f"time step{pooled}")
    fig.suptitle(f"{layer}: SQNR per time step (higher is better)", fontsize=11)
    FigureCanvasSVG(fig)
    buffer = io.StringIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": f"steps-{layer}"}):
        fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    """Equal series, up to the rounding of energies summed in another order."""
    return len(a) == len(b) and all(
        x == y or abs(x - y) < 1e-6 * max(abs(x), 1.0) for x, y in zip(a, b, strict=True)
    )


def step_lines(
    comparisons: Mapping[str, Comparison],
) -> dict[str, list[tuple[str, str, tuple[float, ...]]]]:
    """Per recurrent layer, ``(variant, series, steps)`` of every compared variant: the
    output first, then the states in layer order."""
    layers: dict[str, list[tuple[str, str, tuple[float, ...]]]] = {}
    for variant, comparison in comparisons.items():
        rows = sorted(
            (r for r in comparison.rows if r.steps),
            key=lambda r: (r.series != "output", r.series.partition(" ")[2], r.series),
        )
        outputs = {r.layer: r.steps for r in rows if r.series == "output"}
        for row in rows:
            if row.series != "output" and _same(outputs.get(row.layer, ()), row.steps):
                continue  # a one-layer loop's hidden state is the output: drawn once
            layers.setdefault(row.layer or row.name, []).append((variant, row.series, row.steps))
    return layers


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

    def svg(self, markup: str, alt: str) -> None:
        if not markup.lstrip().startswith("<svg"):
            raise ValueError(f"{alt}: not an SVG image")
        self.parts.append(f'<figure role="img" aria-label="{html.escape(alt)}">{markup}</figure>')

    def time_steps(self, comparisons: Mapping[str, Comparison]) -> None:
        """Error along the sequence: per recurrent layer, one chart and one table of the
        SQNR per time step of its output (and, in cells mode, of each state it carries)."""
        layers = step_lines(comparisons)
        if not layers:
            return
        self.heading("Error along the sequence")
        self.paragraph(
            "SQNR of each recurrent layer's output at every time step (in cells mode also of "
            "each state the cell carries: hidden, cell; per layer and direction). A line that "
            "falls along the sequence is quantization error feeding back through the state: "
            "cells mode, an int16 cell state or int16 activations (A16W8Quantizer) hold it "
            "back. A flat line says the layer's error does not grow."
        )
        rows = []
        for layer, lines in layers.items():
            self.svg(steps_chart(layer, lines), f"{layer}: SQNR per time step")
            for variant, series, steps in lines:
                noisy = [(v, t) for t, v in enumerate(steps) if v != math.inf]
                worst = min(noisy, default=(math.inf, 0))
                rows.append(
                    (
                        layer,
                        variant,
                        series,
                        len(steps),
                        sqnr_text(steps[0]),
                        sqnr_text(steps[-1]),
                        f"{sqnr_text(worst[0])} at t{worst[1]}",
                    )
                )
        self.table(["layer", "variant", "series", "steps", "first dB", "last dB", "worst dB"], rows)

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
                    sqnr_text(r.sqnr_db),
                )
                for r in comparison.rows
            ],
        )
        if comparison.unmatched:  # never dropped silently: what has no row, and why
            self.paragraph(f"{len(comparison.unmatched)} float tensor(s) not compared:")
            self.table(
                ["tensor", "op", "why"],
                [(u.name, u.op, u.reason) for u in comparison.unmatched],
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


def embedded_svgs(page: str) -> list[str]:
    """The SVG charts inlined in a report's HTML."""
    images, start = [], page.find("<svg")
    while start >= 0:
        end = page.index("</svg>", start) + len("</svg>")
        images.append(page[start:end])
        start = page.find("<svg", end)
    return images


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
