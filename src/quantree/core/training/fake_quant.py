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

from quantree.core.observing.qparams import SCALE_FLOOR, half_exact
from quantree.core.specs import Derivation, FixedSpec, QParams, QuantSpec


class FakeQuant(nn.Module):
    """What the three kinds share: ``qparams()`` for convert, and an on/off switch."""

    label: str

    @property
    def calibrated(self) -> bool:
        return True

    @property
    def learning(self) -> bool:
        """Whether training moves this group's parameters directly."""
        return False

    def qparams(self) -> QParams:  # pragma: no cover - each kind defines it
        raise NotImplementedError


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def fake_quantize_ste(x: torch.Tensor, p: QParams) -> torch.Tensor:
    """``dequantize(quantize(x))`` with gradients to ``x`` (straight through) and ``p.scale``.

    The composite form, for parameters computed in the forward (derived and fixed groups);
    learned groups use torch's fused learnable kernels.
    """
    scale, zp = p.scale, p.zero_point.to(x.dtype)
    if p.axis is not None:
        shape = [1] * x.dim()
        shape[p.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    q = torch.clamp(round_ste(x / scale) + zp, p.quant_min, p.quant_max)
    return (q - zp) * scale


class LearnedFakeQuant(FakeQuant):
    """A calibrated group's fake quantization whose scale is a learned ``nn.Parameter``."""

    def __init__(
        self, params: QParams, spec: QuantSpec, label: str, *, learnable: bool = True
    ) -> None:
        super().__init__()
        self.spec = spec
        self.learnable = learnable and not spec.power_of_two
        self.label = label
        self.dtype = params.dtype
        self.quant_min, self.quant_max = params.quant_min, params.quant_max
        self.axis = params.axis
        scale = params.scale.detach().float().reshape(-1).clone()
        self.scale = nn.Parameter(scale, requires_grad=self.learnable)
        self.zero_point: torch.Tensor
        self.register_buffer("zero_point", params.zero_point.detach().float().reshape(-1))

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
        return fake_quantize_ste(x, self.params)

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
        return fake_quantize_ste(x, self.live_params())

    def qparams(self) -> QParams:
        p = self.live_params()
        return QParams(p.scale.detach(), p.zero_point, p.dtype, p.quant_min, p.quant_max, p.axis)

    def extra_repr(self) -> str:
        return f"{self.label}, {self.derivation.dtype.value} derived"
