"""Quantization specs: small frozen values, validated on construction.

A spec says how one Value (an output leaf) or one Use (an input edge) is quantized.
Options are enums so a typo fails at construction, not deep inside convert.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from quantree.core.errors import QuantreeError
from quantree.core.observing.grouped import check_group_size

if TYPE_CHECKING:
    from quantree.core.values import Use, Value


class QDtype(enum.Enum):
    """Integer storage types a quantized tensor can take."""

    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    INT32 = "int32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @property
    def bounds(self) -> tuple[int, int]:
        info = torch.iinfo(self.torch_dtype)
        return int(info.min), int(info.max)


_TORCH_DTYPES = {
    QDtype.INT8: torch.int8,
    QDtype.UINT8: torch.uint8,
    QDtype.INT16: torch.int16,
    QDtype.INT32: torch.int32,
}


class ObserverKind(enum.Enum):
    """How calibration statistics become a range.

    MINMAX keeps the extremes; MOVING_AVERAGE smooths them over batches; HISTOGRAM keeps a
    histogram and searches the clipping range that minimises the expected squared error.
    SEARCH chooses each point's range among min-max, min-max with a margin (where
    calibration saw few values), percentile clips and the histogram's clip, by the error each
    measures on calibration batches it was not computed from
    (``core/observing/search.py``). A spec with an ``axis`` observes per channel: min-max per
    channel for every kind except SEARCH, which searches each channel's clip by its exact
    error (what weights need).
    """

    MINMAX = "minmax"
    MOVING_AVERAGE = "moving_average"
    HISTOGRAM = "histogram"
    SEARCH = "search"


@dataclass(frozen=True)
class QuantSpec:
    """Quantize with parameters computed from calibration statistics.

    ``quant_min``/``quant_max`` default to the dtype's full range. ``power_of_two`` rounds the
    scale up to a power of two (the integer-LSTM convention for cell state). ``group_size``
    (symmetric int8 weights per channel on axis 0 only): 4-bit codes with a scale per group of
    that many input columns, held on the channel's int8 grid (``quantree.core.observing.grouped``).
    ``clamped`` (per tensor): every op that reads the tensor clamps it to this interval (a
    ReLU, ReLU6 or hardtanh that is not fused into its producer), so calibration observes the
    values clamped: a grid spent on values its readers discard is resolution lost on the
    ones they keep.
    """

    dtype: QDtype = QDtype.INT8
    symmetric: bool = False
    axis: int | None = None
    observer: ObserverKind = ObserverKind.MINMAX
    quant_min: int | None = None
    quant_max: int | None = None
    power_of_two: bool = False
    group_size: int | None = None
    clamped: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, QDtype):
            raise QuantreeError(f"QuantSpec.dtype must be a QDtype, got {self.dtype!r}")
        if self.clamped is not None and not (
            self.axis is None
            and len(self.clamped) == 2
            and all(isinstance(b, int | float) for b in self.clamped)
            and self.clamped[0] <= 0.0 <= self.clamped[1]
        ):
            raise QuantreeError(
                "QuantSpec.clamped must be a (low, high) pair of numbers with low <= 0 <= high, "
                f"on a per-tensor spec (axis=None), got {self.clamped!r} with axis={self.axis}"
            )
        check_group_size(self.group_size)
        if self.group_size is not None and not (
            self.dtype is QDtype.INT8 and self.symmetric and self.axis == 0
        ):
            raise QuantreeError(
                "QuantSpec.group_size needs a symmetric int8 weight spec per channel on axis 0 "
                f"(dtype=QDtype.INT8, symmetric=True, axis=0), got dtype={self.dtype.value}, "
                f"symmetric={self.symmetric}, axis={self.axis}"
            )
        if not isinstance(self.observer, ObserverKind):
            raise QuantreeError(
                f"QuantSpec.observer must be an ObserverKind, got {self.observer!r}"
            )
        lo, hi = self.dtype.bounds
        qmin, qmax = self.range
        if not lo <= qmin < qmax <= hi:
            raise QuantreeError(
                f"QuantSpec range [{qmin}, {qmax}] does not fit {self.dtype.value} [{lo}, {hi}]"
            )

    @property
    def range(self) -> tuple[int, int]:
        lo, hi = self.dtype.bounds
        return (
            lo if self.quant_min is None else self.quant_min,
            hi if self.quant_max is None else self.quant_max,
        )


@dataclass(frozen=True)
class FixedSpec:
    """Parameters known in advance (a sigmoid output in [0, 1) needs no calibration)."""

    scale: float
    zero_point: int
    dtype: QDtype = QDtype.INT8
    quant_min: int | None = None
    quant_max: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, QDtype):
            raise QuantreeError(f"FixedSpec.dtype must be a QDtype, got {self.dtype!r}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise QuantreeError(f"FixedSpec.scale must be positive and finite, got {self.scale}")
        qmin, qmax = self.range
        if not qmin <= self.zero_point <= qmax:
            raise QuantreeError(
                f"FixedSpec.zero_point {self.zero_point} is outside [{qmin}, {qmax}]"
            )

    @property
    def range(self) -> tuple[int, int]:
        lo, hi = self.dtype.bounds
        return (
            lo if self.quant_min is None else self.quant_min,
            hi if self.quant_max is None else self.quant_max,
        )


@dataclass(frozen=True)
class SharedSpec:
    """Use exactly the parameters of another Value or Use (one observer for both).

    ``dtype``, when given, states the dtype this member expects; prepare checks it against
    the group's, so an int8 tensor never silently shares an int16 one's parameters.
    """

    target: Value | Use
    dtype: QDtype | None = None


@dataclass(frozen=True)
class QParams:
    """Concrete quantization parameters of one sharing group."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    dtype: QDtype
    quant_min: int
    quant_max: int
    axis: int | None = None
    group_size: int | None = None
    """Weights: 4-bit codes with a multiplier per group of this many columns
    (``quantree.core.observing.grouped``); the dequantize is the plain per-channel one."""

    @property
    def per_channel(self) -> bool:
        return self.axis is not None


@dataclass(frozen=True)
class DerivedSpec:
    """Parameters computed from the parameters of other Values or Uses.

    ``derive`` receives the QParams of ``derived_from`` in order. The classic case is an
    int32 bias whose scale is input scale x weight scale: see ``bias_spec``.
    """

    derived_from: tuple[Value | Use, ...]
    derive: Callable[[Sequence[QParams]], QParams] = field(compare=False)
    dtype: QDtype = QDtype.INT32

    def __post_init__(self) -> None:
        if not self.derived_from:
            raise QuantreeError("DerivedSpec needs at least one Value or Use to derive from")

    @property
    def derivation(self) -> Derivation:
        return Derivation(self.derive, self.dtype)


@dataclass(frozen=True)
class Derivation:
    """A DerivedSpec without its sources: what convert calls once they are group ids.

    Sharing groups keep this instead of the DerivedSpec, whose Values and Uses hold graph
    nodes (with FakeTensor metadata): ``GraphModule.__deepcopy__`` deep-copies ``meta``, so
    node references there would make prepared and converted models impossible to copy.
    """

    derive: Callable[[Sequence[QParams]], QParams]
    dtype: QDtype


Spec = QuantSpec | FixedSpec | SharedSpec | DerivedSpec
SPEC_TYPES = (QuantSpec, FixedSpec, SharedSpec, DerivedSpec)


def product_of_scales(params: Sequence[QParams]) -> QParams:
    """int32 bias parameters: scale = product of the input scales, zero point 0.

    Per-channel if any source is per-channel (the weight). The bias is 1-D, one entry per
    output channel, so its axis is 0 whatever axis the weight keeps its output channels on
    (1 for a transposed convolution's ``[in, out, kh, kw]``).
    """
    scale = params[0].scale.double()
    for p in params[1:]:
        scale = scale * p.scale.double()
    scale = scale.float()
    axis = 0 if any(p.per_channel for p in params) else None
    lo, hi = QDtype.INT32.bounds
    return QParams(scale, torch.zeros_like(scale, dtype=torch.int64), QDtype.INT32, lo, hi, axis)


def bias_spec(input_use: Use, weight_use: Use | Value) -> DerivedSpec:
    """The int32 bias of a linear/conv/recurrent layer: scale = input scale x weight scale."""
    return DerivedSpec((input_use, weight_use), product_of_scales, QDtype.INT32)


def int8_activation(observer: ObserverKind = ObserverKind.MINMAX) -> QuantSpec:
    return QuantSpec(QDtype.INT8, symmetric=False, observer=observer)


def int8_weight(axis: int | None = 0, observer: ObserverKind = ObserverKind.MINMAX) -> QuantSpec:
    """Symmetric int8 weights on [-127, 127], so -w quantizes exactly like w."""
    return QuantSpec(
        QDtype.INT8, symmetric=True, axis=axis, observer=observer, quant_min=-127, quant_max=127
    )
