"""Tensor-only observers: identity modules that collect calibration statistics.

Observers never see tuples: prepare places them on tensor leaves. Each belongs to one
sharing group and carries that group's label so a bad batch names the nodes involved.
Statistics are buffers, so ``state_dict``/``load_state_dict`` save and restore them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from quantree.core.errors import QuantreeError
from quantree.core.qparams import qparams_from_range
from quantree.core.specs import ObserverKind, QParams, QuantSpec


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
                    raise QuantreeError(
                        f"calibration data produced NaN or infinite values at {self.label}; "
                        "remove non-finite inputs from the calibration set"
                    )
                self.observe(x32, lo, hi)
                self.num_batches.add_(1)
        return x

    def _reduce(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        axis = self.spec.axis
        if axis is None:
            return torch.aminmax(x)
        return torch.aminmax(x.transpose(0, axis).reshape(x.shape[axis], -1), dim=1)

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if not self.calibrated:
            self.min_val, self.max_val = lo, hi
        else:
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
    """Extremes smoothed over batches, less sensitive to one outlier batch."""

    def __init__(self, spec: QuantSpec, label: str, averaging_constant: float = 0.01) -> None:
        super().__init__(spec, label)
        self.averaging_constant = averaging_constant

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if not self.calibrated:
            self.min_val, self.max_val = lo, hi
        else:
            c = self.averaging_constant
            self.min_val.add_(c * (lo - self.min_val))
            self.max_val.add_(c * (hi - self.max_val))


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
        if not self.calibrated:
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


def make_observer(spec: QuantSpec, label: str) -> Observer:
    """The observer a spec asks for; per-channel specs always use min-max per channel."""
    kind = ObserverKind.MINMAX if spec.axis is not None else spec.observer
    return _OBSERVERS[kind](spec, label)
