"""Range search for weights, per channel: a constant is seen whole, so the search is exact.

Per channel, the clip of its range among ``RATIOS`` whose quantize-dequantize error is
least, min-max included (``search.py`` holds the activations' search, which must generalise
from calibration batches to new inputs; here there is nothing to generalise to).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantree.core.errors import QuantreeError
from quantree.core.observing.observers import Observer
from quantree.core.observing.qparams import fake_quantize, qparams_from_range
from quantree.core.specs import QParams, QuantSpec

RATIOS = tuple(1.0 - i / 40 for i in range(21))
"""Per-channel weight clips tried, as fractions of the channel's range (1.0 is min-max)."""

MAX_STORED = 1 << 22
"""Values a per-channel search keeps; past it (a per-channel activation) it keeps min-max."""


class ChannelSearchObserver(Observer):
    """Per-channel range search on the values themselves (weights: seen whole at prepare)."""

    values: torch.Tensor

    def __init__(self, spec: QuantSpec, label: str) -> None:
        if spec.axis is None:
            raise QuantreeError("ChannelSearchObserver is per-channel; give the spec an axis")
        super().__init__(spec, label)
        self.register_buffer("values", torch.empty(0))
        self.choice = ""

    def observe(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        super().observe(x, lo, hi)
        axis = self.spec.axis
        assert axis is not None
        rows = x.transpose(0, axis).reshape(x.shape[axis], -1)
        if not int(self.num_batches):
            self.values = rows.clone()
        elif self.values.numel():
            self.values = torch.cat((self.values, rows), dim=1)
        if self.values.numel() > MAX_STORED:
            self.values = torch.empty(0)  # too much to keep (an activation): min-max

    def clear(self) -> None:
        super().clear()
        self.values = torch.empty(0)

    def qparams(self) -> QParams:
        if not self.calibrated or self.only_zeros or not self.values.numel():
            self.choice = "minmax"
            return super().qparams()
        best_err = torch.full((self.values.shape[0],), math.inf)
        best_ratio = torch.ones(self.values.shape[0])
        for ratio in RATIOS:
            p = qparams_from_range(self.min_val * ratio, self.max_val * ratio, self.spec)
            err = ((fake_quantize(self.values, _on_axis0(p)) - self.values) ** 2).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, torch.tensor(ratio), best_ratio)
        clipped = int((best_ratio < 1).sum())
        self.choice = f"mse clip on {clipped} of {best_ratio.numel()} channels"
        return qparams_from_range(self.min_val * best_ratio, self.max_val * best_ratio, self.spec)

    def _merge_statistics(
        self, group: Any, table: torch.Tensor, since_shared: bool, numel: int
    ) -> None:
        """Weights are observed alike on every rank: rank 0's values stand for all."""
        if int(table[1:, 3].sum()):
            raise QuantreeError(
                f"the per-channel range search of {self.label} saw values on several processes; "
                "it merges only constants (weights): give per-channel activations "
                "ObserverKind.MINMAX"
            )
        self.min_val, self.max_val = self._merged_extremes(group, numel)

    def merge_signature(self) -> str:
        return f"ChannelSearch {super().merge_signature()}"


def _on_axis0(p: QParams) -> QParams:
    """``p`` for values laid out channel first (rows), as the search keeps them."""
    return QParams(p.scale, p.zero_point, p.dtype, p.quant_min, p.quant_max, 0, p.group_size)
