"""Tensor-only observers: identity modules that collect calibration statistics.

Observers never see tuples: prepare places them on tensor leaves. Each belongs to one
sharing group and carries that group's label so a bad batch names the nodes involved.
Statistics are buffers, so ``state_dict``/``load_state_dict`` save and restore them.

An all-zero tensor carries no range information (every grid holds 0 exactly): it calibrates
an observer that has seen nothing else, but never moves statistics gathered from real
values, and the first tensor that is not all zero initialises them. So a default (zero)
initial state sharing an observer with the state a recurrent layer returns, or the zero
state at the first step of a cell loop, does not drag the range towards 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quantree.core.errors import QuantreeError
from quantree.core.qparams import qparams_from_range
from quantree.core.specs import ObserverKind, QParams, QuantSpec


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
    """

    num_averaged: torch.Tensor

    def __init__(self, spec: QuantSpec, label: str, averaging_constant: float = 0.01) -> None:
        super().__init__(spec, label)
        self.averaging_constant = averaging_constant
        self.register_buffer("num_averaged", torch.zeros((), dtype=torch.int64))
        self._window: tuple[torch.Tensor, torch.Tensor] | None = None
        self._depth = 0

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
            return
        self.num_averaged.add_(1)
        c = max(self.averaging_constant, 1.0 / int(self.num_averaged))
        self.min_val.add_(c * (lo - self.min_val))
        self.max_val.add_(c * (hi - self.max_val))

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

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.only_zeros or not bool(self.histogram.any()):
            self.min_val, self.max_val = lo, hi
            self.histogram = torch.histc(x, self.bins, float(lo), float(hi))
            return
        new_lo, new_hi = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)
        if bool(new_lo < self.min_val) or bool(new_hi > self.max_val):
            self.histogram = self._rebin(new_lo, new_hi)
            self.min_val, self.max_val = new_lo, new_hi
        self.histogram += torch.histc(x, self.bins, float(self.min_val), float(self.max_val))

    def _centers(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        width = (hi - lo) / self.bins
        return lo + width * (torch.arange(self.bins, dtype=torch.float32) + 0.5)

    def _rebin(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        centers = self._centers(self.min_val, self.max_val)
        width = torch.clamp((hi - lo) / self.bins, min=1e-12)
        index = torch.clamp(((centers - lo) / width).long(), 0, self.bins - 1)
        return torch.zeros(self.bins).index_add_(0, index, self.histogram)

    def qparams(self) -> QParams:
        if not self.calibrated:
            return super().qparams()
        centers = self._centers(self.min_val, self.max_val)
        counts = self.histogram
        qmin, qmax = self.spec.range
        frac = torch.linspace(1.0 / self.grid, 1.0, self.grid)
        lo_all = torch.clamp(self.min_val, max=0.0)
        hi_all = torch.clamp(self.max_val, min=0.0)
        if self.spec.symmetric:
            bound = torch.maximum(-lo_all, hi_all) * torch.linspace(1.0 / 256, 1.0, 256)
            lo_c, hi_c = -bound, bound
        else:
            lo_c = (lo_all * frac)[:, None].expand(self.grid, self.grid).reshape(-1)
            hi_c = (hi_all * frac)[None, :].expand(self.grid, self.grid).reshape(-1)
        step = (hi_c - lo_c) / (qmax - qmin)
        c = centers[None, :]
        below = torch.clamp(lo_c[:, None] - c, min=0.0)
        above = torch.clamp(c - hi_c[:, None], min=0.0)
        inside = ((below == 0) & (above == 0)).float()
        err = (counts * (below**2 + above**2 + inside * (step[:, None] ** 2) / 12)).sum(dim=1)
        best = int(torch.argmin(err))
        return qparams_from_range(lo_c[best], hi_c[best], self.spec)


_OBSERVERS: dict[ObserverKind, type[Observer]] = {
    ObserverKind.MINMAX: MinMaxObserver,
    ObserverKind.MOVING_AVERAGE: MovingAverageMinMaxObserver,
    ObserverKind.HISTOGRAM: HistogramObserver,
}


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


def make_observer(spec: QuantSpec, label: str) -> Observer:
    """The observer a spec asks for; per-channel specs always use min-max per channel."""
    kind = ObserverKind.MINMAX if spec.axis is not None else spec.observer
    return _OBSERVERS[kind](spec, label)
