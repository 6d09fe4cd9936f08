"""Error along the sequence: SQNR of a recurrent layer's output at every time step.

Recurrent layers feed their quantization error back into themselves, so the error can grow
along the sequence; whether it does is what tells whole mode, cells mode or an int16 state
apart for a given model, and a single SQNR over the whole sequence hides it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from quantree.core.values import Path
from quantree.recurrent.call import RECURRENT_OPS, RecurrentCall
from quantree.recurrent.loop import CellLoop, RecurrentCells
from quantree.recurrent.split_layers import SPLIT_LAYER_KEY
from quantree.tools.metrics import sqnr_from_energies

STATE_POINTS = ("hidden", "cell")
"""The named points of a cell body that the loop carries to the next step (docs/recurrent.md)."""


def time_axis(node: fx.Node, path: Path, root: torch.nn.Module | None = None) -> int | None:
    """The time axis of leaf ``path`` of ``node`` if it is a recurrent layer's output
    sequence (leaf 0 of ``aten.lstm``/``gru``/``rnn_*``, or of the cells-mode module that
    replaced one, on a padded batch), else None. ``root`` holds ``node``'s submodules."""
    if tuple(path) != (0,):
        return None
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(str(node.target))
        packed = len(node.args) > 2 and node.args[2] is not None
        if isinstance(module, RecurrentCells) and not packed:
            return 1 if module.batch_first else 0
        return None
    if node.op != "call_function" or node.target not in RECURRENT_OPS:
        return None
    return 1 if RecurrentCall.parse(node).batch_first else 0


def module_path(node: fx.Node) -> str:
    """The path of the user's module that ran ``node`` (``encoder.rnn``), or ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def layer_label(node: fx.Node) -> str:
    """The user's name for the layer ``node`` runs (``encoder.rnn``), else the node's name."""
    return module_path(node) or node.name


def output_series(node: fx.Node) -> str:
    """``output`` for a layer's output sequence; ``output l0`` for a layer below the last of a
    stacked call that prepare split (``recurrent/split_layers.py``), as cells mode names its
    per-layer states."""
    layer = node.meta.get(SPLIT_LAYER_KEY)
    return f"output l{layer}" if isinstance(layer, int) else "output"


def cell_state(root: torch.nn.Module, scope: str, name: str) -> tuple[str, str, bool] | None:
    """For Value ``name`` of the nested graph at ``scope``: when it is a state a cells-mode
    loop carries between steps (one call of the body is one step), the path of the module
    that replaced the recurrent layer, the series name (``cell l0_reverse``) and whether the
    loop runs backwards in time; else None."""
    if name not in STATE_POINTS:
        return None
    loop_path = scope.rpartition(".")[0]
    try:
        loop = root.get_submodule(loop_path)
    except AttributeError:
        return None
    if not isinstance(loop, CellLoop):
        return None
    loops_path, _, key = loop_path.rpartition(".")
    return loops_path.rpartition(".")[0], f"{name} {key}", loop.reverse


def step_energies(
    reference: torch.Tensor, test: torch.Tensor, axis: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per time step: the reference's energy and the error's, summed over the other axes."""
    r = reference.double()
    others = [d for d in range(r.dim()) if d != axis]
    return r.pow(2).sum(others), (r - test.double()).pow(2).sum(others)


def step_sqnrs(signal: torch.Tensor, noise: torch.Tensor) -> tuple[float, ...]:
    return tuple(sqnr_from_energies(float(s), float(n)) for s, n in zip(signal, noise, strict=True))


def call_sqnrs(signal: list[float], noise: list[float], reverse: bool) -> tuple[float, ...]:
    """Per-step SQNR from energies gathered per call of a cell body, in time order (a
    reverse loop's first call is the last step; batches of other lengths shift it)."""
    steps = step_sqnrs(torch.tensor(signal, dtype=torch.float64), torch.tensor(noise))
    return steps[::-1] if reverse else steps


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
