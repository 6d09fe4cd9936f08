"""Tensors of the float model that ``compare`` could not read in the quantized model, and why.

A row that silently goes missing reads as "this layer is fine": the user never learns that a
layer was not compared at all. So every float tensor compare records but cannot pair with
one of the quantized model is listed with its reason (fused into a kernel, unused by the
model, not computed on the batches given, another shape), and ``Comparison.render`` prints
the list after the rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

NOT_A_GRAPH = "the quantized model is not a GraphModule: only its outputs are compared"
NEVER_RAN = "not computed by the quantized model on the batches given"
NO_OUTPUT = "the quantized model has no output at this position"


@dataclass(frozen=True)
class Unmatched:
    """A float tensor with no row: its would-be row name, its node, and why."""

    name: str
    node: str
    op: str
    reason: str

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "node": self.node, "op": self.op, "reason": self.reason}


def shapes_differ(float_shape: tuple[int, ...], quantized_shape: tuple[int, ...]) -> str:
    return f"its shape differs: float {list(float_shape)}, quantized {list(quantized_shape)}"


def render_unmatched(unmatched: Iterable[Unmatched], names: int = 6) -> str:
    """One line per reason, naming the tensors it holds for (the first ``names`` of them)."""
    by_reason: dict[str, list[str]] = {}
    for u in unmatched:
        by_reason.setdefault(u.reason, []).append(u.name)
    if not by_reason:
        return ""
    total = sum(len(v) for v in by_reason.values())
    lines = [f"not compared: {total} float tensor(s) without a counterpart"]
    for reason, found in by_reason.items():
        shown = ", ".join(found[:names]) + (
            f", ... ({len(found)} in all)" if len(found) > names else ""
        )
        lines.append(f"  {shown}: {reason}")
    return "\n".join(lines)
