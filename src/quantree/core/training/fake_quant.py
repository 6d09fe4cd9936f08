"""Fake quantization that trains: one module per sharing group of a QAT model.

A QAT model computes ``dequantize(quantize(x))`` in float wherever the reference graph will
hold a q/dq pair, so training sees the rounding and clipping the deployed int8 model has.
Three kinds, one for each kind of group:

- :class:`LearnedFakeQuant` (a ``QuantSpec`` group): its scale starts where calibration put
  it and is then learned, LSQ-style (Esser et al., "Learned Step Size Quantization"): the
  rounding passes gradients straight through inside the range and the scale's gradient is
  scaled by ``1 / sqrt(numel * quant_max)`` so it moves at the pace of the weights. The
  zero point stays where calibration put it (an integer, as the reference graph needs).
  Per-channel weights learn one scale a channel. A ``power_of_two`` spec keeps its
  calibrated scale (a learned one would leave the grid the spec promises), and so does a
  group calibration only ever saw zeros in (a zero initial state): its tensors are exact
  at the zero point whatever the scale, which no data can teach.
- :class:`FixedFakeQuant` (a ``FixedSpec`` group): known parameters, gradients straight
  through to the input only.
- :class:`DerivedFakeQuant` (a ``DerivedSpec`` group, the int32 bias): its parameters are
  derived in every forward from its sources' current ones, by the spec's own ``derive``, so
  the bias grid follows the input and weight scales as they learn and gradients reach them.

Every kind answers ``qparams()`` (and ``calibrated``) as an observer does, so ``convert``
reads the learned parameters exactly where it reads calibrated ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from quantree.core.errors import QuantreeError
from quantree.core.grouping.overflow import overflow
from quantree.core.observing.observers import Observer
from quantree.core.observing.qparams import SCALE_FLOOR, half_exact
from quantree.core.specs import Derivation, FixedSpec, QParams, QuantSpec


class FakeQuant(nn.Module):
    """What the three kinds share: ``qparams()`` for convert, and the two phases.

    Until :meth:`start` every kind passes its input through unchanged (a learned group's
    observer records it), so calibrating a QAT model is calibrating the prepared one; from
    then on each fake-quantizes.
    """

    label: str
    started: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        # a buffer, so a QAT checkpoint (state dict) keeps the phase with the scales
        self.register_buffer("started", torch.zeros((), dtype=torch.bool))

    @property
    def calibrated(self) -> bool:
        return True

    @property
    def learning(self) -> bool:
        """Whether training moves this group's parameters directly."""
        return False

    def start(self) -> None:
        self.started.fill_(True)

    def qparams(self) -> QParams:  # pragma: no cover - each kind defines it
        raise NotImplementedError


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def fake_quantize_ste(x: torch.Tensor, p: QParams) -> torch.Tensor:
    """``dequantize(quantize(x))`` with gradients to ``x`` (straight through) and ``p.scale``.

    The composite form, for parameters computed in the forward (derived and fixed groups);
    learned groups use torch's fused learnable kernels. It multiplies by the float32
    reciprocal of the scale, as ``quantized_decomposed.quantize_per_*`` (convert's q op)
    does: ``x / scale`` rounds differently at a few grid boundaries, which is enough to move
    an int32 bias by one of its units and the layer's output by one step downstream.
    """
    scale, zp = p.scale.to(torch.float32), p.zero_point.to(x.dtype)
    if p.axis is not None:
        shape = [1] * x.dim()
        shape[p.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    q = torch.clamp(round_ste(x * (1.0 / scale)) + zp, p.quant_min, p.quant_max)
    return (q - zp) * scale


class LearnedFakeQuant(FakeQuant):
    """A calibrated group's fake quantization whose scale is a learned ``nn.Parameter``.

    It holds the group's observer until :meth:`start` turns the observed range into the
    first scale and zero point (in place: an optimizer made before keeps the parameter).
    """

    def __init__(self, observer: Observer, spec: QuantSpec, label: str) -> None:
        super().__init__()
        if spec.group_size is not None:  # the fake quant would train on the int8 grid
            raise QuantreeError(
                f"{label}: quantization-aware training of grouped 4-bit weights (group_size="
                f"{spec.group_size}) is not built; train with per-channel 4-bit weights "
                "(qt.W4A8Quantizer() without group_size) or quantize post-training with groups"
            )
        self.spec = spec
        self.label = label
        self.observer: Observer | None = observer
        self.learnable = not spec.power_of_two
        self.frozen = False
        self.dtype = spec.dtype
        self.quant_min, self.quant_max = spec.range
        self.axis = spec.axis
        shape = (1,) if spec.axis is None else (0,)  # per channel: sized at start
        self.scale = nn.Parameter(torch.ones(shape), requires_grad=self.learnable)
        self.zero_point: torch.Tensor
        self.register_buffer("zero_point", torch.zeros(shape))
        if observer.calibrated and spec.axis is not None:  # a weight: observed at prepare
            self._take(observer.qparams())

    @property
    def calibrated(self) -> bool:
        return bool(self.started) or (self.observer is not None and self.observer.calibrated)

    @property
    def empty_batches(self) -> int:
        return 0 if self.observer is None else self.observer.empty_batches

    def _take(self, params: QParams) -> None:
        with torch.no_grad():
            self.scale.data = params.scale.detach().float().reshape(-1).clone()
            self.zero_point = params.zero_point.detach().float().reshape(-1).clone()

    def start(self) -> None:
        """The observed range becomes the first scale; the observer goes.

        A group calibration only ever saw zeros in keeps its scale (see the module's notes).
        """
        if bool(self.started):
            return
        assert self.observer is not None
        self._take(self.observer.qparams())
        if self.observer.only_zeros:
            self.learnable = False
        self.observer = None
        self.scale.requires_grad_(self.learnable and not self.frozen)
        super().start()

    def freeze(self, frozen: bool) -> None:
        self.frozen = frozen
        self.scale.requires_grad_(self.learnable and not frozen)

    @property
    def learning(self) -> bool:
        return self.scale.requires_grad

    def current_scale(self) -> torch.Tensor:
        """The scale the forward uses: positive, and per channel on the saved 11-bit grid."""
        scale = torch.clamp(self.scale, min=SCALE_FLOOR)
        if self.axis is not None:  # what convert stores (qparams.half_exact), straight through
            scale = scale + (half_exact(scale.detach()) - scale).detach()
        return scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.started):
            return x if self.observer is None else self.observer(x)
        if not x.numel():
            return x
        scale = self.current_scale()
        channels = scale.numel()
        grad_factor = 1.0 / math.sqrt(max(x.numel() // channels, 1) * max(self.quant_max, 1))
        if self.axis is None:
            return torch._fake_quantize_learnable_per_tensor_affine(
                x, scale, self.zero_point, self.quant_min, self.quant_max, grad_factor
            )
        return torch._fake_quantize_learnable_per_channel_affine(
            x, scale, self.zero_point, self.axis % x.dim(), self.quant_min, self.quant_max,
            grad_factor,
        )  # fmt: skip

    def qparams(self) -> QParams:
        if not bool(self.started):
            assert self.observer is not None
            return self.observer.qparams()
        scale = self.current_scale().detach()
        zero_point = self.zero_point.round().to(torch.int64)
        if self.axis is None:
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        return QParams(scale, zero_point, self.dtype, self.quant_min, self.quant_max, self.axis)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.axis is not None else "per-tensor"
        return f"{self.label}, {self.dtype.value} {kind}, learning={self.learning}"


class FixedFakeQuant(FakeQuant):
    """A ``FixedSpec`` group: parameters known in advance, never learned."""

    def __init__(self, params: QParams, spec: FixedSpec, label: str) -> None:
        super().__init__()
        self.spec = spec
        self.label = label
        self.params = params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_ste(x, self.params) if bool(self.started) else x

    def qparams(self) -> QParams:
        return self.params

    def extra_repr(self) -> str:
        return f"{self.label}, fixed scale {float(self.params.scale):.6g}"


class DerivedFakeQuant(FakeQuant):
    """A ``DerivedSpec`` group: parameters derived from its sources' in every forward.

    The sources are other fake-quant modules of the same graph, held outside the module
    tree (they are registered once, under their own names), so a state dict lists each
    learned scale once.
    """

    def __init__(self, derivation: Derivation, sources: Sequence[FakeQuant], label: str) -> None:
        super().__init__()
        self.derivation = derivation
        self.label = label
        self.sources: tuple[FakeQuant, ...]
        object.__setattr__(self, "sources", tuple(sources))

    def live_params(self) -> QParams:
        """What ``derive`` makes of the sources' current parameters, gradients kept."""
        sources: list[QParams] = []
        for source in self.sources:
            if isinstance(source, LearnedFakeQuant):
                p = source.qparams()
                scale = source.current_scale()
                scale = scale.reshape(()) if source.axis is None else scale
                sources.append(
                    QParams(scale, p.zero_point, p.dtype, p.quant_min, p.quant_max, p.axis)
                )
            elif isinstance(source, DerivedFakeQuant):
                sources.append(source.live_params())
            else:
                sources.append(source.qparams())
        return self.derivation.derive(sources)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.started):
            return x
        p = self.live_params()
        if isinstance(x, nn.Parameter) and overflow(x, p) is not None:
            return x  # a bias its range cannot hold: convert keeps it float, so does training
        return fake_quantize_ste(x, p)

    def qparams(self) -> QParams:
        p = self.live_params()
        return QParams(p.scale.detach(), p.zero_point, p.dtype, p.quant_min, p.quant_max, p.axis)

    def extra_repr(self) -> str:
        return f"{self.label}, {self.derivation.dtype.value} derived"
