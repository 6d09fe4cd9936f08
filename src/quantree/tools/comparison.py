"""The result of ``compare``: one row per compared tensor, and what could not be compared.

Kept apart from the comparing itself so that the tools that only show a comparison (the
report, the CLI) read these types without the matching machinery.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from quantree.core.values import Path
from quantree.tools.matching import OUTPUT, VALUE, WEIGHT
from quantree.tools.metrics import sqnr_from_energies, sqnr_text
from quantree.tools.time_steps import render_steps
from quantree.tools.unmatched import Unmatched, render_unmatched


class RowKind(enum.Enum):
    """What a row measures: a node's output leaf, a constant an op reads, or a model output."""

    VALUE = VALUE
    WEIGHT = WEIGHT
    OUTPUT = OUTPUT


@dataclass(frozen=True)
class TensorRow:
    """SQNR of one tensor over every compared batch."""

    name: str  # "lstm[1]", "head.weight -> linear[1]", "output", "<scope>/gates_split[0] (i_pre)"
    node: str  # node name, prefixed by "<scope>/" inside a nested graph
    path: Path
    kind: RowKind
    op: str
    quantization: str  # "int8", "int16", "int8 per-channel", or "float" (no q/dq found)
    shape: tuple[int, ...]
    signal: float  # sum of squares of the float tensor
    noise: float  # sum of squares of (float - quantized)
    order: int  # position in the float graph
    steps: tuple[float, ...] = ()  # SQNR dB per time step of a recurrent output or state
    layer: str = ""  # with steps: the recurrent layer they belong to (its module path)
    series: str = ""  # with steps: "output", or a cells-mode state ("cell l0_reverse")
    read_at: tuple[str, Path] | None = None
    """Where the quantized graph was read: a node (of the row's scope) and the leaf path in
    its output, or in its arguments for a constant; None for a model output."""
    module: str = ""
    """The user's module the row belongs to (``layer1.0.conv1``, ``lstm``): a fused kernel's
    row is its conv's, a split or cells-mode recurrent layer's rows are the layer's."""
    clamped: tuple[float, float] | None = None
    """The interval every reader of the tensor clamps it to, when each does (a sum read
    only by a ReLU): both tensors were compared clamped to it, as the readers see them."""

    @property
    def sqnr_db(self) -> float:
        return sqnr_from_energies(self.signal, self.noise)

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node": self.node,
            "path": list(self.path),
            "kind": self.kind.value,
            "op": self.op,
            "quantization": self.quantization,
            "shape": list(self.shape),
            "sqnr_db": self.sqnr_db,
            "steps_sqnr_db": list(self.steps),
            "layer": self.layer,
            "series": self.series,
            "module": self.module,
            "clamped": list(self.clamped) if self.clamped is not None else None,
        }


@dataclass(frozen=True)
class Comparison:
    """The rows of :func:`compare`, worst SQNR first."""

    rows: tuple[TensorRow, ...]
    batches: int
    unmatched: tuple[Unmatched, ...] = ()
    """Float tensors with no row, each with the reason (printed by ``render``)."""

    def records(self) -> list[dict[str, Any]]:
        return [row.record() for row in self.rows]

    def row(self, name: str) -> TensorRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row named {name!r}; rows: {[r.name for r in self.rows]}")

    @property
    def outputs(self) -> tuple[TensorRow, ...]:
        return tuple(r for r in self.rows if r.kind is RowKind.OUTPUT)

    def render(self, limit: int | None = None) -> str:
        rows = self.rows[:limit] if limit is not None else self.rows
        width = max([len("tensor"), *(len(r.name) for r in rows)])
        opw = max([len("op"), *(len(r.op) for r in rows)])
        lines = [
            f"per-tensor SQNR over {self.batches} batch(es), worst first",
            f"{'tensor':<{width}}  {'op':<{opw}}  {'quantized as':<18}  {'shape':<16}  SQNR dB",
        ]
        for r in rows:
            shape = "x".join(str(s) for s in r.shape) or "scalar"
            lines.append(
                f"{r.name:<{width}}  {r.op:<{opw}}  {r.quantization:<18}  {shape:<16}  "
                + f"{sqnr_text(r.sqnr_db):>7}"
                + (" *" if r.clamped is not None else "")
            )
        if limit is not None and len(self.rows) > limit:
            lines.append(f"... and {len(self.rows) - limit} more")
        clamped = [f"{r.name} [{r.clamped[0]:g}, {r.clamped[1]:g}]" for r in rows if r.clamped]
        if clamped:
            lines.append(
                "* every reader clamps it: compared as they see it, both clamped to "
                + ", ".join(clamped)
            )
        steps = render_steps((r.name, r.steps) for r in self.rows)
        missing = render_unmatched(self.unmatched)
        return "\n".join([*lines, *([steps] if steps else []), *([missing] if missing else [])])

    def __str__(self) -> str:
        return self.render()
