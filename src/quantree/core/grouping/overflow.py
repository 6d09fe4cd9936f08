"""Derived constants that do not fit their integer range: kept float, never clamped.

A derived group's scale is not computed from the values it quantizes: an int32 bias sits on
input scale x weight scale whatever the bias holds. Where that product is tiny (a 16-bit
input read by 16-bit weights, or an input or weight of tiny range), an ordinary bias reaches
past ``2**31 - 1`` and the q op clamps it to a fraction of its value without a sign. Such a
constant stays float in the reference graph instead, beside its layer's integer weight and
activations: a float bias between q/dq'd operands is a valid pt2e reference, and every
backend that matches weighted layers adds a float bias in float. A bias that fits keeps its
integers, so a model whose biases fit converts exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from quantree.core.specs import QParams


@dataclass(frozen=True)
class Overflow:
    """How far a constant reaches past its range on its grid: for the warning."""

    outside: int  # how many values would be clamped
    total: int
    factor: float  # the largest value over the range's end it passes (> 1)
    smallest_scale: float


def overflow(value: torch.Tensor, p: QParams) -> Overflow | None:
    """What clamping ``value`` to ``p``'s range would cut, or None when every value fits.

    The integers are computed in float64: the q op's float32 arithmetic rounds
    ``2**31 - 1`` up, which says nothing about whether the value fits.
    """
    if not value.is_floating_point() or value.numel() == 0:
        return None
    x = value.detach().double()
    scale, zero_point = p.scale.double(), p.zero_point.double()
    if p.axis is not None and scale.numel() > 1:
        shape = [1] * x.dim()
        shape[p.axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    q = torch.round(x / scale) + zero_point
    low, high = float(p.quant_min), float(p.quant_max)
    outside = (q > high) | (q < low)
    count = int(outside.sum())
    if count == 0:
        return None
    over_high = float((q / high).max()) if high > 0 else 0.0
    over_low = float((q / low).max()) if low < 0 else 0.0
    return Overflow(count, x.numel(), max(over_high, over_low), float(p.scale.min()))


def describe_overflow(source: fx.Node, found: Overflow, p: QParams, label: str) -> str:
    """One constant's entry in the warning: the node, who reads it, how far it reaches."""
    readers = ", ".join(f"{u.name} ({u.target})" for u in source.users) or "no node"
    return (
        f"{source.name} read by {readers}: {found.outside} of {found.total} values reach "
        f"{found.factor:.3g}x the {p.dtype.value} range [{p.quant_min}, {p.quant_max}] on the "
        f"derived scale of {label} (down to {found.smallest_scale:.3g})"
    )


def kept_float_warning(entries: list[str]) -> str:
    """The one warning convert gives for every derived constant it kept float."""
    shown = "; ".join(entries[:10])
    more = f"; and {len(entries) - 10} more" if len(entries) > 10 else ""
    return (
        f"quantree kept {len(entries)} derived constant(s) float: their derived scale (a "
        "bias's is its input scale x weight scale) is too fine for their integer type, and "
        f"quantizing would clamp them: {shown}{more}. The layer still reads integer weights "
        "and activations and adds the bias in float, as every backend can; to have an "
        "integer bias, give the layer an 8-bit input or weight (e.g. "
        "Int8Quantizer(conv1d_weight_dtype=QDtype.INT8)) or a wider input range"
    )
