"""Tensor-only observers: identity modules that collect calibration statistics.

Over 400 lines: the three observer kinds share the statistics contract (buffers, the
all-zero rule, merging across ranks) that the base class states once.

Observers never see tuples: prepare places them on tensor leaves. Each belongs to one
sharing group and carries that group's label so a bad batch names the nodes involved.
Statistics are buffers, so ``state_dict``/``load_state_dict`` save and restore them.

An all-zero tensor carries no range information (every grid holds 0 exactly): it calibrates
an observer that has seen nothing else, but never moves statistics gathered from real
values, and the first tensor that is not all zero initialises them. So a default (zero)
initial state sharing an observer with the state a recurrent layer returns, or the zero
state at the first step of a cell loop, does not drag the range towards 0.

Each observer kind also says how its statistics combine across processes (``merge``, a
collective over a ``torch.distributed`` process group): N processes that each observed 1/N
of the data end with the statistics one process gets from all of it, in rank order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from quantree.core.errors import QuantreeError
from quantree.core.observing.qparams import qparams_from_range
from quantree.core.specs import QParams, QuantSpec


class NonFiniteValues(QuantreeError):
    """An observer saw NaN or infinity; ``label`` names its sharing group.

    The caller knows where the tensor came from (a parameter at prepare, a calibration
    batch) and raises a message that says which and what to do.
    """

    def __init__(self, label: str) -> None:
        super().__init__(
            f"NaN or infinite values reached the observer of {label}: a calibration input, a "
            "parameter or buffer of the model, or an op that overflowed produced them"
        )
        self.label = label


class Observer(nn.Module):
    """Base class: checks its input, records statistics, returns the input unchanged."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    num_batches: torch.Tensor

    def __init__(self, spec: QuantSpec, label: str) -> None:
        super().__init__()
        self.spec = spec
        self.label = label
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))
        self.register_buffer("num_batches", torch.zeros((), dtype=torch.int64))
        # only to explain an observer that never calibrated (not state: no buffer)
        self.empty_batches = 0
        # counters when every process last held the same statistics (see ``mark_shared``)
        self._shared_counts: tuple[int, int] | None = None

    @property
    def calibrated(self) -> bool:
        # the extremes are empty until the first batch (cheaper than reading num_batches:
        # observers inside cell loops run once per time step)
        return self.min_val.numel() > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise QuantreeError(
                f"observer of {self.label} received {type(x).__name__} "
                f"{getattr(x, 'dtype', '')}; observers only take float tensors"
            )
        if not x.numel():
            self.empty_batches += 1
        else:
            with torch.no_grad():
                x32 = x.float()
                if self.spec.clamped is not None:  # what every reader keeps
                    x32 = x32.clamp(*self.spec.clamped)
                lo, hi = self._reduce(x32)
                # min and max propagate NaN and keep infinities: checking them checks all
                finite = (
                    math.isfinite(lo.item() + hi.item())
                    if lo.dim() == 0
                    else bool(torch.isfinite(lo + hi).all())
                )
                if not finite:
                    raise NonFiniteValues(self.label)
                if not self.calibrated:
                    self.min_val, self.max_val = lo, hi  # all zeros too: a [0, 0] range
                    if not self.only_zeros:
                        self.observe(x32, lo, hi)
                elif not _all_zero(lo, hi):
                    self.observe(x32, lo, hi)
                self.num_batches.add_(1)
        return x

    @property
    def only_zeros(self) -> bool:
        """Calibrated, but every tensor seen so far was all zeros."""
        return self.calibrated and _all_zero(self.min_val, self.max_val)

    def begin_call(self) -> None:
        """A loop is about to call this observer once per step of one calibration batch."""

    def end_call(self) -> None:
        """The loop's batch is over (see ``per_call``)."""

    def _reduce(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        axis = self.spec.axis
        if axis is None:
            return torch.aminmax(x)
        return torch.aminmax(x.transpose(0, axis).reshape(x.shape[axis], -1), dim=1)

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Fold one tensor's extremes ``lo``/``hi`` into the statistics.

        Called with the statistics already holding something (the first tensor's extremes,
        or a [0, 0] range while ``only_zeros``); never called with an all-zero tensor once
        the observer is calibrated.
        """
        torch.minimum(self.min_val, lo, out=self.min_val)
        torch.maximum(self.max_val, hi, out=self.max_val)

    def qparams(self) -> QParams:
        if not self.calibrated:
            raise QuantreeError(
                f"{self.label} has no calibration statistics; run the prepared model on "
                "calibration data before convert"
            )
        return qparams_from_range(self.min_val, self.max_val, self.spec)

    def clear(self) -> None:
        """Forget every statistic, as a fresh observer."""
        self.min_val, self.max_val = torch.empty(0), torch.empty(0)
        self.num_batches.zero_()
        self.empty_batches = 0
        self._shared_counts = None

    def mark_shared(self) -> None:
        """Every process now holds these statistics alike (merged, or a constant at prepare).

        The next merge takes them from rank 0 alone and from each other rank only what it
        observes after this, so a weight every process observed, or a second merge, counts
        nothing twice. Observing goes on as before on every rank (convert reads the lot).
        """
        self._shared_counts = (int(self.num_batches), self.empty_batches)

    def merge_signature(self) -> str:
        """What must agree across processes for ``merge`` to combine two observers."""
        return f"{type(self).__name__} {self.spec}"

    def merge(self, group: Any = None) -> None:
        """Combine the statistics of this observer on every process of ``group`` (collective).

        Every rank calls it, in the same order for the same observers (a rank that observed
        nothing too), and every rank ends with the same statistics: those one process gets
        from every rank's batches in rank order. Statistics every rank holds alike (merged
        ones, constants observed at prepare) are carried by rank 0 alone: the other ranks
        start afresh at their next observation, so merging again, or a weight every process
        observed, counts nothing twice. A rank whose tensors were all zeros contributes no
        range, as in one process. ``group`` spans every process (rank 0 is the world's).
        """
        rank = dist.get_rank(group)
        since_shared = rank != 0 and self._shared_counts is not None
        table = torch.stack(_all_gather(self._merge_header(since_shared), group))
        real = table[:, 1].bool()
        batches, empty = int(table[:, 3].sum()), int(table[:, 4].sum())
        if bool(real.any()):
            sizes = table[real, 2]
            if int(sizes.min()) != int(sizes.max()):
                raise QuantreeError(
                    f"the observer of {self.label} has {sizes.tolist()} channel(s) on the ranks "
                    "that calibrated it; every process must calibrate the same model on "
                    "tensors of the same channel count"
                )
            self._merge_statistics(group, table, since_shared, int(sizes[0]))
        else:
            self.clear()
            if bool(table[:, 0].any()):  # calibrated on zeros only: a [0, 0] range
                zeros = torch.zeros(self._stat_shape(int(table[:, 2].max())))
                self.min_val, self.max_val = zeros, zeros.clone()
        self.num_batches.fill_(batches)
        self.empty_batches = empty
        self.mark_shared()

    def _merge_header(self, since_shared: bool) -> torch.Tensor:
        """[calibrated, has real values, statistic size, batches, empty batches, kind's own].

        ``since_shared``: count only what this rank observed since ``mark_shared``.
        """
        batches, empty = int(self.num_batches), self.empty_batches
        if since_shared and self._shared_counts is not None:
            batches, empty = batches - self._shared_counts[0], empty - self._shared_counts[1]
        real = self.calibrated and not self.only_zeros
        return torch.tensor(
            [
                int(self.calibrated),
                int(real),
                self.min_val.numel(),
                batches,
                empty,
                self._header_extra(since_shared),
            ],
            dtype=torch.int64,
        )

    def _header_extra(self, since_shared: bool) -> int:
        return 0

    def _stat_shape(self, numel: int) -> tuple[int, ...]:
        return () if self.spec.axis is None else (numel,)

    def _merge_statistics(
        self, group: Any, table: torch.Tensor, since_shared: bool, numel: int
    ) -> None:
        """Min-max: the extremes of the extremes, exactly (shared ones again do no harm)."""
        self.min_val, self.max_val = self._merged_extremes(group, numel)

    def _merged_extremes(self, group: Any, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Minimum of minima and maximum of maxima in one all_reduce (MIN of ``-max``)."""
        if self.calibrated and not self.only_zeros:
            both = torch.cat((self.min_val.flatten(), -self.max_val.flatten())).float()
        else:
            both = torch.full((2 * numel,), math.inf)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
        shape = self._stat_shape(numel)
        return both[:numel].reshape(shape).clone(), (-both[numel:]).reshape(shape)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Buffers are sized by the first batch (per-channel length); take the saved shapes.
        for name, _ in self.named_buffers(recurse=False):
            saved = state_dict.get(prefix + name)
            if saved is not None:
                setattr(self, name, torch.empty_like(saved))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return f"{self.label}: {self.spec.dtype.value}"


class MinMaxObserver(Observer):
    """Running extremes over every batch."""


class MovingAverageMinMaxObserver(Observer):
    """Extremes averaged over batches, less sensitive to one outlier batch.

    The first tensor that is not all zeros initialises the average; the ``n``-th moves it
    by ``max(averaging_constant, 1 / n)``: a plain mean of the per-batch extremes over the
    first ``1 / averaging_constant`` batches (so a short calibration is not dominated by
    where it started), an exponential average after. Inside a cell loop
    (``begin_call``/``end_call``) the extremes of every step of one batch count as one
    observation, so the weight is per batch, not per time step.

    The average depends on the order of the batches, so to merge across processes each
    observer keeps the extremes it averaged (two numbers a batch per tensor), and the merge
    replays every rank's in rank order: the merged average is bit for bit the one a single
    process computes from every rank's batches in rank order (contiguous shards, as
    ``quantree.shard`` makes, give one process's order on all the data). Statistics loaded
    from a ``state_dict`` have no such record; they merge as the average of the ranks'
    averages weighted by their batch counts, which is exact while the total stays within the
    first ``1 / averaging_constant`` batches (a plain mean) and an approximation after.
    """

    num_averaged: torch.Tensor

    def __init__(self, spec: QuantSpec, label: str, averaging_constant: float = 0.01) -> None:
        super().__init__(spec, label)
        self.averaging_constant = averaging_constant
        self.register_buffer("num_averaged", torch.zeros((), dtype=torch.int64))
        self._window: tuple[torch.Tensor, torch.Tensor] | None = None
        self._depth = 0
        self._averaged: list[tuple[torch.Tensor, torch.Tensor]] = []  # for merge
        self._shared_averaged = 0  # how many of them every process holds alike

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self._depth:
            window = self._window
            self._window = (
                (lo, hi)
                if window is None
                else (torch.minimum(window[0], lo), torch.maximum(window[1], hi))
            )
            return
        self._average(lo, hi)

    def _average(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.only_zeros or not int(self.num_averaged):
            self.min_val, self.max_val = lo.clone(), hi.clone()
            self.num_averaged.fill_(1)
            self._averaged = [(lo, hi)]
            return
        self._averaged.append((lo, hi))
        self.num_averaged.add_(1)
        c = max(self.averaging_constant, 1.0 / int(self.num_averaged))
        self.min_val.add_(c * (lo - self.min_val))
        self.max_val.add_(c * (hi - self.max_val))

    def clear(self) -> None:
        super().clear()
        self.num_averaged.zero_()
        self._averaged = []
        self._shared_averaged = 0

    def mark_shared(self) -> None:
        super().mark_shared()
        self._shared_averaged = len(self._averaged)

    def _own(self, since_shared: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._averaged[self._shared_averaged :] if since_shared else self._averaged

    def merge_signature(self) -> str:
        return f"{super().merge_signature()} averaging_constant={self.averaging_constant}"

    def _header_extra(self, since_shared: bool) -> int:
        """How many averaged extremes this rank contributes; -1 if it lacks their record."""
        complete = len(self._averaged) == int(self.num_averaged)
        return len(self._own(since_shared)) if complete else -1

    def _merge_statistics(
        self, group: Any, table: torch.Tensor, since_shared: bool, numel: int
    ) -> None:
        shape = self._stat_shape(numel)
        counts = [int(n) if bool(r) else 0 for n, r in zip(table[:, 5], table[:, 1], strict=True)]
        if min(counts) < 0:
            self._merge_weighted(group, since_shared, numel)
            return
        mine = torch.zeros(max(counts), 2, numel)
        if counts[dist.get_rank(group)]:
            for i, (lo, hi) in enumerate(self._own(since_shared)):
                mine[i, 0], mine[i, 1] = lo.flatten(), hi.flatten()
        gathered = _all_gather(mine, group)
        self.clear()
        for count, extremes in zip(counts, gathered, strict=True):
            for lo, hi in extremes[:count]:
                self._average(lo.reshape(shape).clone(), hi.reshape(shape).clone())

    def _merge_weighted(self, group: Any, since_shared: bool, numel: int) -> None:
        """Averages without their record (loaded statistics): weighted by batch counts.

        A rank other than 0 holding shared statistics has no average of its own to give
        apart from them, so it gives none.
        """
        real = self.calibrated and not self.only_zeros and not since_shared
        n = float(self.num_averaged) if real else 0.0
        total = torch.zeros(2 * numel + 1)
        if real:
            total[:numel] = n * self.min_val.flatten()
            total[numel : 2 * numel] = n * self.max_val.flatten()
            total[-1] = n
        dist.all_reduce(total, group=group)
        shape = self._stat_shape(numel)
        self.clear()
        self.min_val = (total[:numel] / total[-1]).reshape(shape)
        self.max_val = (total[numel : 2 * numel] / total[-1]).reshape(shape)
        self.num_averaged.fill_(round(float(total[-1])))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # statistics saved before num_averaged existed: every batch counted
        if prefix + "num_batches" in state_dict:
            state_dict.setdefault(prefix + "num_averaged", state_dict[prefix + "num_batches"])
        super()._load_from_state_dict(state_dict, prefix, *args)

    def begin_call(self) -> None:
        self._depth += 1

    def end_call(self) -> None:
        self._depth -= 1
        if not self._depth and self._window is not None:
            lo, hi = self._window
            self._window = None
            self._average(lo, hi)


def clip_candidates(
    min_val: torch.Tensor, max_val: torch.Tensor, symmetric: bool, grid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped ranges a histogram's error search tries: 256 symmetric bounds, or every
    pair of ``grid`` fractions of the observed negative and positive extremes."""
    lo_all = torch.clamp(min_val, max=0.0)
    hi_all = torch.clamp(max_val, min=0.0)
    if symmetric:
        bound = torch.maximum(-lo_all, hi_all) * torch.linspace(1.0 / 256, 1.0, 256)
        return -bound, bound
    frac = torch.linspace(1.0 / grid, 1.0, grid)
    lo_c = (lo_all * frac)[:, None].expand(grid, grid).reshape(-1)
    hi_c = (hi_all * frac)[None, :].expand(grid, grid).reshape(-1)
    return lo_c, hi_c


class HistogramObserver(Observer):
    """A histogram of all values; the range is the clip that minimises expected MSE.

    Quantization error inside the range is modelled as uniform (step^2 / 12 per value) and
    values outside are clipped; a grid of candidate ranges is scored in one tensor pass.
    """

    histogram: torch.Tensor

    def __init__(self, spec: QuantSpec, label: str, bins: int = 2048, grid: int = 64) -> None:
        if spec.axis is not None:
            raise QuantreeError("HistogramObserver is per-tensor; use MINMAX with an axis")
        super().__init__(spec, label)
        self.bins = bins
        self.grid = grid
        self.register_buffer("histogram", torch.zeros(bins))
        self._shared_histogram: torch.Tensor | None = None  # re-binned alongside, for merge

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.only_zeros or not bool(self.histogram.any()):
            self.min_val, self.max_val = lo, hi
            self.histogram = torch.histc(x, self.bins, float(lo), float(hi))
            return
        new_lo, new_hi = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)
        if bool(new_lo < self.min_val) or bool(new_hi > self.max_val):
            if self._shared_histogram is not None:  # re-binning is linear: subtract later
                self._shared_histogram = self._rebin(new_lo, new_hi, self._shared_histogram)
            self.histogram = self._rebin(new_lo, new_hi)
            self.min_val, self.max_val = new_lo, new_hi
        self.histogram += torch.histc(x, self.bins, float(self.min_val), float(self.max_val))

    def _centers(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        width = (hi - lo) / self.bins
        return lo + width * (torch.arange(self.bins, dtype=torch.float32) + 0.5)

    def _rebin(
        self, lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``counts`` (the histogram by default) over the current range, moved onto [lo, hi]."""
        centers = self._centers(self.min_val, self.max_val)
        width = torch.clamp((hi - lo) / self.bins, min=1e-12)
        index = torch.clamp(((centers - lo) / width).long(), 0, self.bins - 1)
        source = self.histogram if counts is None else counts
        return torch.zeros(self.bins).index_add_(0, index, source)

    def clear(self) -> None:
        super().clear()
        self.histogram = torch.zeros(self.bins)
        self._shared_histogram = None

    def mark_shared(self) -> None:
        super().mark_shared()
        self._shared_histogram = self.histogram.clone()

    def merge_signature(self) -> str:
        return f"{super().merge_signature()} bins={self.bins} grid={self.grid}"

    def _merge_statistics(
        self, group: Any, table: torch.Tensor, since_shared: bool, numel: int
    ) -> None:
        """Each rank's histogram re-binned onto the common range, then summed.

        The range is exactly one process's (the extremes of all values); the counts differ
        from one process's only by where re-binning put them: one process re-bins whenever a
        batch widens the range, a merge once per rank. The chosen clipping range is then the
        same or a neighbouring candidate of the search grid. Counts are whole numbers in
        float32, so the shared ones subtract exactly (below 2**24 per bin).
        """
        lo, hi = self._merged_extremes(group, numel)
        own = self.histogram
        if since_shared and self._shared_histogram is not None:
            own = self.histogram - self._shared_histogram
        if not (self.calibrated and not self.only_zeros):
            counts = torch.zeros(self.bins)
        elif bool(lo == self.min_val) and bool(hi == self.max_val):
            counts = own.clone()
        else:
            counts = self._rebin(lo, hi, own)
        dist.all_reduce(counts, group=group)
        self.min_val, self.max_val, self.histogram = lo, hi, counts

    def qparams(self) -> QParams:
        if not self.calibrated:
            return super().qparams()
        centers = self._centers(self.min_val, self.max_val)
        counts = self.histogram
        qmin, qmax = self.spec.range
        lo_c, hi_c = clip_candidates(self.min_val, self.max_val, self.spec.symmetric, self.grid)
        step = (hi_c - lo_c) / (qmax - qmin)
        c = centers[None, :]
        below = torch.clamp(lo_c[:, None] - c, min=0.0)
        above = torch.clamp(c - hi_c[:, None], min=0.0)
        inside = ((below == 0) & (above == 0)).float()
        err = (counts * (below**2 + above**2 + inside * (step[:, None] ** 2) / 12)).sum(dim=1)
        best = int(torch.argmin(err))
        return qparams_from_range(lo_c[best], hi_c[best], self.spec)


def _all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def _all_zero(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    return not bool(lo.any()) and not bool(hi.any())


@contextlib.contextmanager
def per_call(module: nn.Module) -> Iterator[None]:
    """Observers in ``module`` see one calibration batch while this runs (a loop's steps)."""
    observers = [m for m in module.modules() if isinstance(m, Observer)]
    for observer in observers:
        observer.begin_call()
    try:
        yield
    finally:
        for observer in observers:
            observer.end_call()
