"""mixed_precision: widen the fewest quantization points to int16 (or float) to meet an SQNR.

Each point's cost is measured where it matters, at the model's output: the model is
quantized with that one point widened to int16 and everything else as the quantizer says,
and the output SQNR it gains over the all-quantized model on held-out batches is the
point's cost. (The numeric debugger's per-tensor SQNR says where error appears, not what
it costs at the output: an outlier's error shows at every tensor after it.) Points are
ranked by cost, then the shortest prefix of the ranking that meets the target is found by
bisection, first with the prefix widened to int16 (the wide quantizer's spec on those
points), then, where every point at int16 is not enough and ``allow_float`` says so, with
it left float. Every trial is a full prepare -> calibrate -> convert on the calibration
batches and a float-against-reference run on the held-out ones, so what the result reports
was measured, not predicted: n points cost n + 1 trials to rank, then about 1 + log2(n)
per level tried. Bisection assumes the SQNR grows along the prefix; the chosen prefix is
one measured to meet the target, with the one before it measured not to.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from quantree.core.calibrate import as_args, calibrate
from quantree.core.convert import convert
from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.prepare import prepare
from quantree.core.quantizer import Quantizer
from quantree.recipes.int8 import A16W8Quantizer, Int8Quantizer
from quantree.recipes.mixed import MixedQuantizer, PointKey, Precision
from quantree.recurrent.capture import capture
from quantree.tools.metrics import sqnr_from_energies

META_KEY = "quantree_mixed_precision"
"""``GraphModule.meta`` key of the reference graph: the :class:`MixedPrecision` result."""


class TargetUnreachable(QuantreeError):
    """No widening the search may make meets the target SQNR."""


@dataclass(frozen=True)
class PointCost:
    """What one point costs: the output SQNR (dB) gained by widening it alone to int16."""

    point: PointKey
    cost_db: float


@dataclass(frozen=True)
class MixedPrecision:
    """What :func:`mixed_precision` chose and measured (SQNR in dB on the held-out batches,
    the worst output leaf, signal and noise summed over the batches)."""

    target_db: float
    quantized_db: float  # every point as the quantizer says
    reached_db: float  # with ``widened``
    widened: tuple[tuple[PointKey, Precision], ...]
    ranking: tuple[PointCost, ...]  # every point, costliest first
    trials: int  # prepare -> calibrate -> convert runs made
    calibration_batches: int
    held_out_batches: int
    reference: fx.GraphModule = field(repr=False, compare=False)
    """The reference graph with ``widened`` applied (its meta holds this result too)."""

    @property
    def points(self) -> int:
        return len(self.ranking)

    def render(self) -> str:
        lines = [
            f"target {self.target_db:.1f} dB: all quantized {self.quantized_db:.1f} dB, "
            f"reached {self.reached_db:.1f} dB widening {len(self.widened)} of "
            f"{self.points} points ({self.held_out_batches} held-out batches)"
        ]
        lines += [f"  {point}: {precision.value}" for point, precision in self.widened]
        return "\n".join(lines)


def output_sqnr(
    float_model: torch.nn.Module, quantized: torch.nn.Module, batches: Sequence[Any]
) -> float:
    """The worst output leaf's SQNR (dB), energies summed over ``batches``."""
    signal: list[float] = []
    noise: list[float] = []
    with torch.no_grad():
        for batch in batches:
            args = as_args(batch)
            ref = [t for t in tree_leaves(float_model(*args)) if _is_float(t)]
            got = [t for t in tree_leaves(quantized(*args)) if _is_float(t)]
            if not signal:
                signal, noise = [0.0] * len(ref), [0.0] * len(ref)
            for i, (r, q) in enumerate(zip(ref, got, strict=True)):
                r, q = r.double(), q.double()
                signal[i] += r.pow(2).sum().item()
                noise[i] += (r - q).pow(2).sum().item()
    worst = math.inf
    for s, n in zip(signal, noise, strict=True):
        if n > 0.0:
            worst = min(worst, sqnr_from_energies(s, n))
    return worst


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class _Search:
    """Trials on one captured graph: choices -> held-out output SQNR."""

    def __init__(
        self,
        captured: fx.GraphModule,
        quantizer: Quantizer,
        wide: Quantizer,
        fit: Sequence[Any],
        held_out: Sequence[Any],
    ) -> None:
        self.captured, self.quantizer, self.wide = captured, quantizer, wide
        self.fit, self.held_out = fit, held_out
        self.trials = 0

    def reference(
        self, choices: dict[PointKey, Precision], record: list[PointKey] | None = None
    ) -> fx.GraphModule:
        self.trials += 1
        mixed = MixedQuantizer(self.quantizer, self.wide, choices, record)
        with warnings.catch_warnings():  # a float point is a choice here, not an oversight
            warnings.filterwarnings("ignore", "quantree left", QuantreeWarning)
            prepared = prepare(self.captured, mixed, stacklevel=4)
        calibrate(prepared, self.fit, progress=False)
        return convert(prepared)

    def sqnr(self, choices: dict[PointKey, Precision]) -> float:
        return self.measure(choices)[0]

    def measure(self, choices: dict[PointKey, Precision]) -> tuple[float, fx.GraphModule]:
        ref = self.reference(choices)
        return output_sqnr(self.captured, ref, self.held_out), ref


def mixed_precision(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    calibration: Iterable[Any],
    *,
    target_sqnr: float,
    quantizer: Quantizer | None = None,
    wide: Quantizer | None = None,
    held_out: int | None = None,
    allow_float: bool = True,
) -> MixedPrecision:
    """Widen the fewest points of ``quantizer`` (``Int8Quantizer()`` by default) to int16 or
    float so the output SQNR on held-out calibration batches reaches ``target_sqnr`` dB.

    ``calibration`` is a collection of argument tuples: its last ``held_out`` batches (a
    quarter by default, at least one) measure, the others calibrate. ``wide`` gives a
    widened point's spec (``A16W8Quantizer()`` by default: int16 activations, int8
    weights). Float points are tried only where every point at int16 misses the target and
    ``allow_float``; when nothing meets it, :class:`TargetUnreachable` says what was
    reached. The result's ``reference`` is the chosen reference graph, for ``qt.lower``;
    its ``meta["quantree_mixed_precision"]`` holds the result. ``model`` is not changed.
    """
    if not isinstance(target_sqnr, int | float) or not math.isfinite(target_sqnr):
        raise QuantreeError(f"target_sqnr must be a finite number of dB, got {target_sqnr!r}")
    for name, q in (("quantizer", quantizer), ("wide", wide)):
        if q is not None and not isinstance(q, Quantizer):
            raise QuantreeError(
                f"{name} must be a quantree Quantizer (e.g. quantree.Int8Quantizer()), "
                f"got {type(q).__name__}"
            )
    batches = list(calibration)
    count = max(1, len(batches) // 4) if held_out is None else held_out
    if not 1 <= count < len(batches):
        raise QuantreeError(
            f"mixed_precision needs calibration batches both to calibrate and to measure on: "
            f"got {len(batches)} batch(es) and held_out={held_out!r}; give at least two "
            "batches and 1 <= held_out < their number"
        )
    fit, measure = batches[:-count], batches[-count:]
    captured = capture(model, as_args(fit[0]))
    search = _Search(captured, quantizer or Int8Quantizer(), wide or A16W8Quantizer(), fit, measure)
    points: list[PointKey] = []
    base_ref = search.reference({}, points)
    base = output_sqnr(captured, base_ref, measure)

    def done(
        reached: float,
        widened: dict[PointKey, Precision],
        ref: fx.GraphModule,
        ranking: tuple[PointCost, ...],
    ) -> MixedPrecision:
        result = MixedPrecision(
            float(target_sqnr),
            base,
            reached,
            tuple(widened.items()),
            ranking,
            search.trials,
            len(fit),
            len(measure),
            ref,
        )
        ref.meta[META_KEY] = result
        return result

    if base >= target_sqnr:
        return done(base, {}, base_ref, ())
    gains = [search.sqnr({p: Precision.INT16}) - base for p in points]
    order = sorted(range(len(points)), key=lambda i: (-gains[i], i))
    ranking = tuple(PointCost(points[i], gains[i]) for i in order)
    ranked = [points[i] for i in order]
    best = base
    levels = (Precision.INT16, Precision.FLOAT) if allow_float else (Precision.INT16,)
    for level in levels:
        found = _shortest_prefix(search, ranked, level, target_sqnr)
        if isinstance(found, float):
            best = max(best, found)
            continue
        k, reached, ref = found
        return done(reached, dict.fromkeys(ranked[:k], level), ref, ranking)
    tried = " or float" if allow_float else ""
    fix = (
        "lower target_sqnr"
        if allow_float
        else "pass allow_float=True to leave points float, or lower target_sqnr"
    )
    raise TargetUnreachable(
        f"mixed_precision: no widening of the {len(points)} point(s) to int16{tried} reaches "
        f"{target_sqnr:.1f} dB on the {len(measure)} held-out batch(es): all quantized "
        f"gives {base:.1f} dB, the best widening {best:.1f} dB; {fix}"
    )


def _shortest_prefix(
    search: _Search, ranked: list[PointKey], level: Precision, target: float
) -> tuple[int, float, fx.GraphModule] | float:
    """The shortest k whose first k points at ``level`` meet ``target`` and its SQNR, or
    the SQNR with every point at ``level`` when even that falls short."""
    measured: dict[int, float] = {}
    meeting: dict[int, fx.GraphModule] = {}

    def at(k: int) -> float:
        if k not in measured:
            measured[k], ref = search.measure(dict.fromkeys(ranked[:k], level))
            if measured[k] >= target:  # keep only the shortest prefix meeting it so far
                meeting.clear()
                meeting[k] = ref
        return measured[k]

    if at(len(ranked)) < target:
        return measured[len(ranked)]
    lo, hi = 0, len(ranked)  # at(lo) misses (lo = 0: the all-quantized model), at(hi) meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi, measured[hi], meeting[hi]
