"""Capture of a model whose Python code reads a tensor's value (``int(lengths.max())``).

torch.export refuses such code: the value is unknown while tracing, so a shape built from it
(torchaudio's Conformer builds its padding mask as ``arange(int(max(lengths)))``) cannot be
checked. ``torch.export.draft_export`` traces with the example's real values instead and
keeps each decision it took on them as a runtime assertion in the graph, so the program
is exact for every input that satisfies them and raises on any other; there is nothing of
ours to write, only the assertions to name, since the user did not ask for them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from quantree.core.errors import QuantreeError, QuantreeWarning


def export_on_example_values(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    dynamic_shapes: Any,
    refused: BaseException,
) -> torch.export.ExportedProgram:
    """``draft_export`` of ``model``, after torch.export ``refused`` it on a data-dependent
    expression; one ``QuantreeWarning`` names that expression and the runtime checks kept."""
    try:
        program = torch.export.draft_export(
            model, args, dict(kwargs), dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception as error:
        raise QuantreeError(
            f"torch.export could not capture {type(model).__name__}: {_first_line(refused)} "
            f"(and draft_export, which traces on the example's values, failed: "
            f"{_first_line(error)}). Rewrite the model so no shape depends on a tensor's "
            "value, or mark it with torch._check"
        ) from error
    checks = sorted(
        {
            str(node.args[1]).split(" on node")[0].removeprefix("Runtime assertion failed for ")
            for node in program.graph.nodes
            if node.target is torch.ops.aten._assert_scalar.default and len(node.args) > 1
        }
    )
    shown = "; ".join(checks[:6]) + (f"; and {len(checks) - 6} more" if len(checks) > 6 else "")
    warnings.warn(
        f"{type(model).__name__} reads a tensor's value to decide a shape "
        f"({_first_line(refused)}), which torch.export cannot trace; it was captured on the "
        f"example's values with these runtime checks, and an input that fails one raises: "
        f"{shown or 'none'}",
        QuantreeWarning,
        stacklevel=4,
    )
    return program


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    caused = next((line for line in lines if line.startswith("Caused by")), "")
    return f"{lines[0] if lines else type(error).__name__} {caused}".strip()
