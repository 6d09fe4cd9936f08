"""Derived int32 biases that would not fit their grid stay float: never silently clamped.

A bias's grid is input scale x weight scale. A tiny input range read by tiny weights (or a
16-bit input read by 16-bit weights) makes that grid so fine that a bias of 1.0 passes
``2**31 - 1``; clamped, the layer's output lost its bias (about 2 dB against float before
``core/grouping/overflow.py``). Kept float, the layer follows float to
``SQNR_DB``, convert warns once, and the lowered CPU model follows its reference.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.graphs import fetch_attr
from quantree.core.qdq import DEQUANTIZE_OPS, dequantize_tensor, params_of

SQNR_DB = 60.0
"""Output is ~1.0 (the bias) plus an int8-quantized term of 1e-5: a clamped bias gives ~2 dB."""
LOWERED_VS_REFERENCE_DB = 90.0


class Tiny(nn.Module):
    """A linear and a 1-d convolution on inputs and weights of range ``scale``, biases 1.0."""

    def __init__(self, scale: float = 1e-3) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        with torch.no_grad():
            for layer in (self.fc, self.conv):
                layer.weight.mul_(scale)
                layer.bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x.transpose(1, 2)), self.conv(x)


def _reference(model: nn.Module, scale: float, seed: int = 0) -> tuple[torch.fx.GraphModule, list]:
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(2, 8, 16, generator=gen) * scale,) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())
    qt.calibrate(prepared, data)
    return qt.convert(prepared), data


def _kept_float_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "derived constant(s) float" in str(w.message)]


def test_bias_past_int32_stays_float_and_accurate() -> None:
    torch.manual_seed(0)
    model = Tiny().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, _ = _reference(model, 1e-3)
    found = _kept_float_warnings(caught)
    assert len(found) == 1
    assert "fc_bias read by linear" in found[0] and "conv_bias read by conv1d" in found[0]
    x = (torch.randn(2, 8, 16) * 1e-3,)
    for want, got in zip(model(*x), ref(*x), strict=True):
        assert qt.sqnr(want, got) >= SQNR_DB
    lowered = qt.lower(ref)
    for want, got in zip(ref(*x), lowered(*x), strict=True):
        assert qt.sqnr(want, got) >= LOWERED_VS_REFERENCE_DB


def test_biases_that_fit_stay_int32_without_warning() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, _ = _reference(Tiny(1.0).eval(), 1.0)
    assert not _kept_float_warnings(caught)
    layers = [n for n in ref.graph.nodes if n.name in ("linear", "conv1d")]
    assert len(layers) == 2
    for layer in layers:
        bias = layer.args[2]
        assert bias.target in DEQUANTIZE_OPS and bias.args[-1] == torch.int32


@pytest.mark.parametrize("seed", range(12))
def test_no_bias_is_clamped_at_random_scales(seed: int) -> None:
    """Whatever the input and weight ranges: each bias is int32 within half a step of its
    float value (and the float32 rounding of the dequantize), or the float value itself."""
    rnd = random.Random(seed)
    scale = 10.0 ** rnd.uniform(-4.5, 0.5)
    model = Tiny(10.0 ** rnd.uniform(-4.5, 0.5)).eval()
    with torch.no_grad():
        model.fc.bias.copy_(torch.randn(8) * 10.0 ** rnd.uniform(-2, 2))
        model.conv.bias.copy_(torch.randn(8) * 10.0 ** rnd.uniform(-2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = _reference(model, scale, seed)
    floats = {"linear": model.fc.bias.detach(), "conv1d": model.conv.bias.detach()}
    for node in ref.graph.nodes:
        if node.name not in floats:
            continue
        bias, want = node.args[2], floats[node.name]
        if bias.op == "get_attr":
            assert torch.equal(fetch_attr(ref, bias.target), want)
            continue
        p = params_of(bias, ref)
        got = dequantize_tensor(fetch_attr(ref, bias.args[0].target), p)
        step = p.scale.double().reshape(-1)
        float32 = 2 * torch.finfo(torch.float32).eps * want.double().abs()  # the dq's rounding
        error = (got.double() - want.double()).abs()
        assert bool((error <= step / 2 * (1 + 1e-3) + float32).all())
