"""Ops that derive a call site's constants from tensors every call site shares.

Lowering records them as recipes and ``load`` runs each once (``derived.py`` says why); a
plain ``torch.export.load`` runs them on every call. Each checks its arguments, since a file
may hold them with any.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.registry import op
from quantree.core.errors import QuantreeError
from quantree.core.qdq import dequantize_tensor, quantize_tensor
from quantree.core.specs import QDtype, QParams


def _check(bias: Tensor, weight_scale: Tensor, what: str) -> None:
    if bias.dim() != 1 or weight_scale.numel() not in (1, bias.numel()):
        raise QuantreeError(
            f"quantree.{what}: a bias of shape {tuple(bias.shape)} with "
            f"{weight_scale.numel()} weight scales; the file was not written by "
            "quantree.backends.save (re-save the lowered model)"
        )


def _int32_bias(bias: Tensor, weight_scale: Tensor, input_scale: float) -> tuple[Tensor, QParams]:
    """The bias on the grid input scale x weight scale, as ``convert`` rounds it
    (``product_of_scales``, then ``quantize_per_channel``)."""
    scale = (torch.tensor(input_scale, dtype=torch.float64) * weight_scale.double()).float()
    scale = scale.reshape(-1).expand(bias.numel()).contiguous()
    lo, hi = QDtype.INT32.bounds
    params = QParams(scale, torch.zeros_like(scale, dtype=torch.int64), QDtype.INT32, lo, hi, 0)
    return quantize_tensor(bias, params), params


@op("derived_bias(Tensor bias, Tensor weight_scale, float input_scale) -> Tensor")
def derived_bias(bias: Tensor, weight_scale: Tensor, input_scale: float) -> Tensor:
    """The float bias a layer adds: rounded to its int32 grid, then dequantized."""
    _check(bias, weight_scale, "derived_bias")
    q, params = _int32_bias(bias, weight_scale, input_scale)
    return dequantize_tensor(q, params).float().contiguous()


@op(
    "derived_offset(Tensor row_sums, Tensor? bias, Tensor weight_scale, float input_scale, "
    "int input_zero_point) -> Tensor"
)
def derived_offset(
    row_sums: Tensor,
    bias: Tensor | None,
    weight_scale: Tensor,
    input_scale: float,
    input_zero_point: int,
) -> Tensor:
    """A linear/conv's int32 accumulator offset: zero-point correction plus int32 bias."""
    offset = (-(int(input_zero_point) + 128) * row_sums).to(torch.int32)
    if bias is None:
        return offset
    _check(bias, weight_scale, "derived_offset")
    if bias.numel() != row_sums.numel():
        raise QuantreeError(
            f"quantree.derived_offset: {row_sums.numel()} row sums for a bias of "
            f"{bias.numel()}; the file was not written by quantree.backends.save"
        )
    q, _ = _int32_bias(bias, weight_scale, input_scale)
    return offset + q.to(torch.int32)


@op("derived_scale(Tensor weight_scale, float input_scale) -> Tensor")
def derived_scale(weight_scale: Tensor, input_scale: float) -> Tensor:
    """A linear/conv's output scale per channel: input scale x weight scale, in float32."""
    return (input_scale * weight_scale).float()


@torch.library.register_fake("quantree::derived_bias")
def _(bias, weight_scale, input_scale):
    return bias.new_empty(bias.shape, dtype=torch.float32)


@torch.library.register_fake("quantree::derived_offset")
def _(row_sums, bias, weight_scale, input_scale, input_zero_point):
    return row_sums.new_empty(row_sums.shape, dtype=torch.int32)


@torch.library.register_fake("quantree::derived_scale")
def _(weight_scale, input_scale):
    return weight_scale.new_empty(weight_scale.shape, dtype=torch.float32)


RECIPE_OPS = (
    torch.ops.quantree.derived_bias.default,
    torch.ops.quantree.derived_offset.default,
    torch.ops.quantree.derived_scale.default,
)
