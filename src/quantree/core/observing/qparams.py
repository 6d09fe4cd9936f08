"""From an observed range to (scale, zero_point): the one formula every observer shares."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantree.core.specs import FixedSpec, QParams, QuantSpec

SCALE_FLOOR = torch.finfo(torch.float32).eps
"""The smallest scale a calibrated range gets (a zero range would divide by zero)."""


SCALE_SIGNIFICANT_BITS = 11
"""Per-channel scales keep this many significant bits (float16's): see :func:`half_exact`."""


def half_exact(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (positive float32) rounded to the nearest value of 11 significant bits.

    A per-channel weight scale is stored beside every output channel of the lowered model
    (4 bytes a channel, where the goal allows about 1 for its bias). Rounded this way it is
    exact in float16 times one power of two per tensor, so the saved file holds it in 2
    bytes (``backends/cpu/narrowed.py``). Each scale moves by under 2^-11 (0.05%), up or
    down, so the grid stays on average where the range put it; the extreme weight lands
    within 0.07 of a step of where it did, inside the rounding every weight has. Rounding
    to nearest left the zoo's SQNR as it was; rounding every scale up instead cost a little
    (benchmarks/README.md, "Branch ``size3``").
    """
    drop = 24 - SCALE_SIGNIFICANT_BITS  # of float32's 24 significant bits (23 stored)
    bits = scale.float().contiguous().view(torch.int32)
    rounded = ((bits + (1 << (drop - 1))) >> drop) << drop
    return rounded.view(torch.float32)


def _zero_channels_on_a_common_grid(scale: torch.Tensor) -> torch.Tensor:
    """Per-channel ``scale`` with each all-zero channel given the largest scale of the
    others (1.0 when every channel is zero).

    Any scale holds a channel of zeros exactly, but the floor was not harmless: a layer's
    int32 bias is quantized at input scale x weight scale, so a zero weight row beside a
    bias (xLSTM initialises its gate projections to zero weights and a -10 bias) put the
    bias at -10 / (s_in x 1.2e-7), past int32, where it was clamped to a far smaller
    value: the gate, and the model, lost their accuracy with no error.
    """
    zero = scale == 0
    if not bool(zero.any()):
        return scale
    others = scale[~zero]
    common = others.max() if others.numel() else torch.ones((), dtype=scale.dtype)
    return torch.where(zero, common, scale)


def qparams_from_range(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """Scale and zero point that represent [min_val, max_val] (widened to hold 0 exactly)."""
    qmin, qmax = spec.range
    lo = torch.clamp(min_val.float(), max=0.0)
    hi = torch.clamp(max_val.float(), min=0.0)
    if spec.symmetric:
        bound = torch.maximum(-lo, hi)
        scale = bound / ((qmax - qmin) / 2)
        if spec.axis is not None:
            scale = _zero_channels_on_a_common_grid(scale)
        scale = torch.clamp(scale, min=SCALE_FLOOR)
        if spec.axis is not None:
            scale = half_exact(scale)
        if spec.power_of_two:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        zero_point = torch.full_like(scale, (qmin + qmax + 1) // 2, dtype=torch.int64)
    else:
        scale = (hi - lo) / (qmax - qmin)
        if spec.axis is not None:
            scale = _zero_channels_on_a_common_grid(scale)
        scale = torch.clamp(scale, min=SCALE_FLOOR)
        if spec.axis is not None:
            scale = half_exact(scale)
        if spec.power_of_two:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        zero_point = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax).to(torch.int64)
    return QParams(scale, zero_point, spec.dtype, qmin, qmax, spec.axis, spec.group_size)


def per_channel_mismatch(axis: int, channels: int | None, shape: Sequence[object]) -> str | None:
    """Why ``channels`` parameters on ``axis`` cannot quantize a tensor of ``shape``, or None.

    ``channels`` None checks the axis alone (a spec's parameters are not known before
    calibration). Symbolic sizes are not compared: they are known only at run time.
    """
    if not -len(shape) <= axis < len(shape):
        return f"axis {axis} is out of range for a {len(shape)}-D tensor of shape {list(shape)}"
    size = shape[axis]
    if channels is not None and isinstance(size, int) and size != channels:
        return (
            f"{channels} channel(s) on axis {axis} do not fit the tensor of shape {list(shape)}, "
            f"which has {size}"
        )
    return None


def at_scale_floor(p: QParams) -> bool:
    """Whether any scale of ``p`` is the floor ``qparams_from_range`` clamps to.

    That happens when the observed range is zero (all-zero data, a ReLU that never fired)
    or narrower than the dtype can resolve: every value then rounds to the zero point.
    """
    return bool((p.scale <= SCALE_FLOOR).any())


def fixed_qparams(spec: FixedSpec) -> QParams:
    qmin, qmax = spec.range
    return QParams(
        torch.tensor(spec.scale, dtype=torch.float32),
        torch.tensor(spec.zero_point, dtype=torch.int64),
        spec.dtype,
        qmin,
        qmax,
        None,
    )


def fake_quantize(x: torch.Tensor, p: QParams) -> torch.Tensor:
    """dequantize(quantize(x)) in float, for measuring error during range search."""
    scale, zp = p.scale, p.zero_point
    if p.axis is not None:
        shape = [1] * x.dim()
        shape[p.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    q = torch.clamp(torch.round(x / scale) + zp, p.quant_min, p.quant_max)
    return (q - zp) * scale
