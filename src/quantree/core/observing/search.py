"""Range search: each point's range chosen among several rules by the error it measures.

Min-max, a percentile clip and the histogram's error-minimising clip each suit some tensors
and fail on others; which one a tensor needs is a property of its distribution and of how
much of it calibration saw, so ``ObserverKind.SEARCH`` measures instead of assuming.

Activations (per tensor): a histogram of all values, and beside it one of every other batch
(odd batches; the even ones are the difference). Each candidate range is computed on one half
and its expected squared error (clipping outside, a uniform step^2 / 12 inside) scored on the
other half, both ways round: the choice is the one that held on batches it did not see, the
question a range must answer on new inputs. The winner is then computed on all the data.
With a single batch there is nothing held out, and the choice is scored on the batch itself.

The histograms sit on a grid anchored at 0 whose bin width is a power of two: the finest
such width for which ``bins`` bins starting at the minimum's bin hold every value (and no
finer than 2**-24 of the largest magnitude). A value's bin is then exact (a scaling by a
power of two and a floor) and widening the range merges neighbouring bins in pairs, exactly,
so the counts are those of all the values on the final grid, whatever the order of the
batches. That is what makes the merge across processes exact: each rank's counts, moved to
the grid of all the values, sum to bit for bit one process's (a grid anchored at the minimum
re-bins approximately whenever a batch widens it, and the result depends on where the
batches fell, which no merge can replay without the values).

The candidates: min-max; min-max with a **margin**; percentile clips (where the tail holds at
least one value); the error-minimising clip. The margin is the small-calibration-set rule:
the extremes of n values fall short of those of 10 n, by about the spacing of the top ten
values (exactly so for an exponential tail, closely for a Gaussian one), so each side that
is not pinned at 0 widens by the distance from its extreme to its tenth-most-extreme value.
Where calibration saw few values that distance is large and the held-out score favours it;
with many it is small and a clip usually wins. ``choice`` says which rule each point took.

Weights (per channel): ``channel_search.ChannelSearchObserver``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from quantree.core.observing.observers import HistogramObserver, Observer, clip_candidates
from quantree.core.observing.qparams import qparams_from_range
from quantree.core.specs import QParams, QuantSpec

TAIL = 10
"""The margin extrapolates each extreme to what TAIL times as many values would reach."""

PERCENTILE_TAILS = (1e-3, 1e-4, 1e-5)
"""Fractions of the values a percentile candidate clips on each side."""

NO_EXPONENT = -(1 << 20)
"""The grid exponent before any value (below every real one)."""

Candidate = tuple[torch.Tensor, torch.Tensor]


class RangeSearchObserver(HistogramObserver):
    """Per-tensor range search, held out across batches (see the module's docstring)."""

    odd: torch.Tensor
    num_values: torch.Tensor
    num_calls: torch.Tensor
    exponent: torch.Tensor

    def __init__(self, spec: QuantSpec, label: str, bins: int = 2048, grid: int = 64) -> None:
        super().__init__(spec, label, bins, grid)
        self.register_buffer("odd", torch.zeros(bins))
        self.register_buffer("num_values", torch.zeros((), dtype=torch.int64))
        self.register_buffer("num_calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("exponent", torch.tensor(NO_EXPONENT, dtype=torch.int64))
        self._shared_odd: torch.Tensor | None = None
        self._shared_calls = 0
        self._depth = 0
        self._observed = False  # real values seen in the current call
        self.choice = ""

    # -- observing ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self._depth:
            self._end_of_call()
        return out

    def begin_call(self) -> None:
        self._depth += 1

    def end_call(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._end_of_call()

    def _end_of_call(self) -> None:
        """A call that saw real values takes the next batch position (all zeros take none:
        a zero initial state tells nothing, as for every observer)."""
        if self._observed:
            self.num_calls.add_(1)
            self._observed = False

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.only_zeros or not bool(self.histogram.any()):
            self.min_val, self.max_val = lo, hi
            self.exponent.fill_(self._exponent(lo, hi, NO_EXPONENT))
            self.histogram = torch.zeros(self.bins)
            self.odd = torch.zeros(self.bins)
        else:
            new_lo, new_hi = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)
            if bool(new_lo < self.min_val) or bool(new_hi > self.max_val):
                exponent = self._exponent(new_lo, new_hi, int(self.exponent))
                if self._shared_histogram is not None and self._shared_odd is not None:
                    self._shared_histogram = self._regrid(self._shared_histogram, exponent, new_lo)
                    self._shared_odd = self._regrid(self._shared_odd, exponent, new_lo)
                self.odd = self._regrid(self.odd, exponent, new_lo)
                self.histogram = self._regrid(self.histogram, exponent, new_lo)
                self.min_val, self.max_val = new_lo, new_hi
                self.exponent.fill_(exponent)
        counts = self._count(x)
        self.histogram += counts
        if int(self.num_calls) % 2:
            self.odd += counts
        self.num_values.add_(x.numel())
        self._observed = True

    # -- the grid -------------------------------------------------------------------------

    def _exponent(self, lo: torch.Tensor, hi: torch.Tensor, at_least: int) -> int:
        """The least power-of-two bin width (its exponent, ``at_least`` or more) whose
        ``bins`` bins from ``lo``'s hold ``hi``, no finer than 2**-24 of the largest magnitude.

        Both conditions hold for every wider width, so widening step by step from any
        batch's width ends at the width of all the values: the grid does not depend on order.
        """
        low, high = float(lo), float(hi)
        exponent = max(at_least, math.frexp(max(abs(low), abs(high)))[1] - 24)
        while math.floor(high * 2.0**-exponent) - math.floor(low * 2.0**-exponent) >= self.bins:
            exponent += 1
        return exponent

    def _first(self, exponent: int, lo: torch.Tensor) -> int:
        """The grid index of the first bin (the one that holds ``lo``)."""
        return math.floor(float(lo) * 2.0**-exponent)

    def _count(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s counts on the current grid: exact in float64 (x * 2**-e, then a floor)."""
        exponent = int(self.exponent)
        index = torch.floor(x.detach().double().flatten() * 2.0**-exponent).long()
        index -= self._first(exponent, self.min_val)
        return torch.bincount(index.clamp(0, self.bins - 1), minlength=self.bins).float()

    def _regrid(self, counts: torch.Tensor, exponent: int, lo: torch.Tensor) -> torch.Tensor:
        """``counts`` (on the current grid) on the grid of width 2**``exponent`` from ``lo``:
        every bin of a grid is inside one bin of each wider one, so this moves whole counts."""
        old = int(self.exponent)
        grid = torch.arange(self.bins, dtype=torch.int64) + self._first(old, self.min_val)
        index = torch.bitwise_right_shift(grid, min(exponent - old, 62))  # a floor division
        index -= self._first(exponent, lo)
        return torch.zeros(self.bins).index_add_(0, index.clamp(0, self.bins - 1), counts)

    def _edges(self) -> torch.Tensor:
        exponent = int(self.exponent)
        first = self._first(exponent, self.min_val)
        grid = torch.arange(first, first + self.bins + 1, dtype=torch.float64)
        return (grid * 2.0**exponent).float()

    def _centers(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        edges = self._edges()
        return (edges[:-1] + edges[1:]) / 2

    def clear(self) -> None:
        super().clear()
        self.odd = torch.zeros(self.bins)
        self.num_values.zero_()
        self.num_calls.zero_()
        self.exponent.fill_(NO_EXPONENT)
        self._shared_odd = None
        self._shared_calls = 0

    # -- choosing -------------------------------------------------------------------------

    def qparams(self) -> QParams:
        if not self.calibrated or self.only_zeros:
            return Observer.qparams(self)
        lo, hi = self.search()
        if self.spec.clamped is not None:  # a margin past what the readers keep is waste
            lo, hi = lo.clamp(min=self.spec.clamped[0]), hi.clamp(max=self.spec.clamped[1])
        return qparams_from_range(lo, hi, self.spec)

    def search(self) -> Candidate:
        """The range of the rule that scored best held out; sets ``choice`` to its name."""
        odd = self.odd
        even = self.histogram - odd
        if bool(odd.sum() > 0) and bool(even.sum() > 0):
            scores: dict[str, list[float]] = {}
            for fit, held in ((odd, even), (even, odd)):
                for name, candidate in self.candidates(fit).items():
                    scores.setdefault(name, []).append(self.error(candidate, held))
            ranked = {name: sum(s) for name, s in scores.items() if len(s) == 2}
        else:
            ranked = {
                name: self.error(candidate, self.histogram)
                for name, candidate in self.candidates(self.histogram).items()
            }
        final = self.candidates(self.histogram)
        self.choice = min((name for name in ranked if name in final), key=ranked.__getitem__)
        return final[self.choice]

    def candidates(self, counts: torch.Tensor) -> dict[str, Candidate]:
        """Every rule's range for the values ``counts`` holds (on this observer's bins)."""
        n = float(counts.sum())
        lo, hi = self._extremes(counts)
        found: dict[str, Candidate] = {"minmax": (lo, hi)}
        k = min(float(TAIL), n)
        widen_lo = lo - self._quantile(counts, k) if bool(lo < 0) else torch.zeros(())
        widen_hi = self._quantile(counts, n - k) - hi if bool(hi > 0) else torch.zeros(())
        found["margin"] = (lo + widen_lo.clamp(max=0.0), hi - widen_hi.clamp(max=0.0))
        for tail in PERCENTILE_TAILS:
            if tail * n >= 1.0:
                found[f"percentile {100 * (1 - tail):g}"] = (
                    self._quantile(counts, tail * n),
                    self._quantile(counts, (1 - tail) * n),
                )
        found["mse"] = self.mse(counts)
        return found

    def error(self, candidate: Candidate, counts: torch.Tensor) -> float:
        """Expected squared error of quantizing the values ``counts`` holds on ``candidate``."""
        lo, hi = candidate
        return float(self.errors(lo.reshape(1), hi.reshape(1), counts)[0])

    def errors(self, lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expected squared error of each range ``(lo[i], hi[i])`` over ``counts``.

        Values outside are clipped to the bound, values inside err by a uniform step^2 / 12
        (``HistogramObserver``'s model), each value at its bin's centre; prefix sums of the
        counts and their first two moments make each range cost two searches.
        """
        qmin, qmax = self.spec.range
        lo = torch.clamp(lo.double(), max=0.0)
        hi = torch.clamp(hi.double(), min=0.0)
        if self.spec.symmetric:
            bound = torch.maximum(-lo, hi)
            lo, hi = -bound, bound
        c = self._centers(self.min_val, self.max_val).double()
        n = counts.double()
        zero = torch.zeros(1, dtype=torch.float64)
        count, first, second = (
            torch.cat((zero, torch.cumsum(v, 0))) for v in (n, n * c, n * c * c)
        )
        j = torch.searchsorted(c, lo)  # bins [0, j) lie below lo
        k = torch.searchsorted(c, hi, right=True)  # bins [k, bins) lie above hi
        below = lo * lo * count[j] - 2 * lo * first[j] + second[j]
        above = (
            (second[-1] - second[k])
            - 2 * hi * (first[-1] - first[k])
            + hi * hi * (count[-1] - count[k])
        )
        step = (hi - lo) / (qmax - qmin)
        return below + above + (count[k] - count[j]) * step * step / 12

    def mse(self, counts: torch.Tensor) -> Candidate:
        """The clip of the observed range with the least expected error over ``counts``."""
        lo_c, hi_c = clip_candidates(self.min_val, self.max_val, self.spec.symmetric, self.grid)
        best = int(torch.argmin(self.errors(lo_c, hi_c, counts)))
        return lo_c[best], hi_c[best]

    def _extremes(self, counts: torch.Tensor) -> Candidate:
        """The outer edges of the first and last non-empty bins (exact for all the data)."""
        if counts is self.histogram:
            return self.min_val.clone(), self.max_val.clone()
        filled = torch.nonzero(counts > 0).flatten()
        edges = self._edges()
        return (
            torch.maximum(edges[int(filled[0])], self.min_val),
            torch.minimum(edges[int(filled[-1]) + 1], self.max_val),
        )

    def _quantile(self, counts: torch.Tensor, rank: float) -> torch.Tensor:
        """The value ``rank`` values from the bottom, interpolated inside its bin."""
        cumulative = torch.cumsum(counts, 0)
        index = int(
            torch.searchsorted(cumulative, torch.tensor(float(rank))).clamp(max=self.bins - 1)
        )
        before = float(cumulative[index - 1]) if index else 0.0
        inside = float(counts[index])
        frac = 0.0 if inside <= 0 else min(max((rank - before) / inside, 0.0), 1.0)
        edges = self._edges()
        return edges[index] + frac * (edges[index + 1] - edges[index])

    # -- merging across processes ---------------------------------------------------------

    def mark_shared(self) -> None:
        super().mark_shared()
        self._shared_odd = self.odd.clone()
        self._shared_calls = int(self.num_calls)

    def _header_extra(self, since_shared: bool) -> int:
        """How many calls this rank observed (since shared): where its parity starts."""
        return int(self.num_calls) - (self._shared_calls if since_shared else 0)

    def _merge_statistics(
        self, group: Any, table: torch.Tensor, since_shared: bool, numel: int
    ) -> None:
        """Each rank's counts moved to the grid of all the values and summed: exactly one
        process's (see the module's docstring), each rank's halves swapped where its batches
        start at an odd position of one process's order (rank order)."""
        rank = dist.get_rank(group)
        offset = int(table[:rank, 5].sum())
        own_odd = self.odd
        if since_shared and self._shared_odd is not None:
            own_odd = self.odd - self._shared_odd
        own_all = self.histogram
        if since_shared and self._shared_histogram is not None:
            own_all = self.histogram - self._shared_histogram
        if offset % 2:
            own_odd = own_all - own_odd
        lo, hi = self._merged_extremes(group, numel)
        real = self.calibrated and not self.only_zeros
        widest = torch.tensor([int(self.exponent) if real else NO_EXPONENT], dtype=torch.int64)
        dist.all_reduce(widest, op=dist.ReduceOp.MAX, group=group)
        exponent = self._exponent(lo, hi, int(widest))
        both = torch.zeros(2, self.bins)
        if real:
            both[0] = self._regrid(own_all, exponent, lo)
            both[1] = self._regrid(own_odd, exponent, lo)
        dist.all_reduce(both, group=group)
        values = torch.tensor([int(self.num_values) if real else 0], dtype=torch.int64)
        if since_shared:
            values.zero_()  # rank 0 carries what every rank shares
        dist.all_reduce(values, group=group)
        calls = int(table[:, 5].sum())
        self.min_val, self.max_val = lo, hi
        self.exponent.fill_(exponent)
        self.histogram, self.odd = both[0].clone(), both[1].clone()
        self.num_values.fill_(int(values))
        self.num_calls.fill_(calls)

    def merge_signature(self) -> str:
        return f"RangeSearch {super().merge_signature()}"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}{f', {self.choice}' if self.choice else ''}"
