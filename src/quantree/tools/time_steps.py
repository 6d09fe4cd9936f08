"""Error along the sequence: SQNR of a recurrent layer's output at every time step.

Recurrent layers feed their quantization error back into themselves, so the error can grow
along the sequence; whether it does is what tells whole mode, cells mode or an int16 state
apart for a given model, and a single SQNR over the whole sequence hides it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.fx as fx

from quantree.core.values import Path
from quantree.recurrent.call import RECURRENT_OPS, RecurrentCall


def time_axis(node: fx.Node, path: Path) -> int | None:
    """The time axis of leaf ``path`` of ``node`` if it is a recurrent layer's output
    sequence (leaf 0 of ``aten.lstm``/``gru``/``rnn_*`` on a padded batch), else None."""
    if node.op != "call_function" or node.target not in RECURRENT_OPS or tuple(path) != (0,):
        return None
    return 1 if RecurrentCall.parse(node).batch_first else 0


def step_energies(
    reference: torch.Tensor, test: torch.Tensor, axis: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per time step: the reference's energy and the error's, summed over the other axes."""
    r = reference.double()
    others = [d for d in range(r.dim()) if d != axis]
    return r.pow(2).sum(others), (r - test.double()).pow(2).sum(others)


def step_sqnrs(signal: torch.Tensor, noise: torch.Tensor) -> tuple[float, ...]:
    return tuple(
        math.inf if float(n) == 0.0 else 10.0 * math.log10(max(float(s), 1e-30) / float(n))
        for s, n in zip(signal, noise, strict=True)
    )


def render_steps(rows: Iterable[tuple[str, tuple[float, ...]]], points: int = 8) -> str:
    """One line per layer: SQNR at evenly spaced steps, then the worst step."""
    lines = []
    for name, steps in rows:
        if not steps:
            continue
        picks = sorted({round(i * (len(steps) - 1) / max(points - 1, 1)) for i in range(points)})
        shown = "  ".join(f"t{t}:{steps[t]:.1f}" for t in picks)
        worst = min(range(len(steps)), key=lambda t: steps[t])
        lines.append(f"{name}  {shown}  (worst t{worst}: {steps[worst]:.1f} dB)")
    if not lines:
        return ""
    return "\n".join(["per-step SQNR dB of recurrent outputs (t = time step)", *lines])
