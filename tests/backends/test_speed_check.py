"""The CPU backend says, once, when a lowered model would be no faster than float, and why."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import quantree as qt
from quantree.backends.cpu import cpu_backend, speed_of
from quantree.backends.cpu.speed_check import (
    CostModel,
    check_speed,
    price_float,
    price_lowered,
)

SAID = "would be no faster than the float model"


class FloatTail(nn.Module):
    """A linear worth int8, then a run of ops with no int8 kernel: under every-op activations
    each is read through a dequantize and written through a quantize, which costs more than
    the linear gains. With weighted-inputs activations the run stays float between no
    conversions, and the linear's gain is the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        for _ in range(4):
            y = torch.sin(y) * 0.5
        return y


class ConvNet(nn.Module):
    """Convolutions and a linear large enough for int8 arithmetic to matter."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(8, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 16 * 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.fc(y.flatten(1))


def _quantize(model: nn.Module, shape: tuple[int, ...], **options: object):
    data = [(torch.randn(*shape),) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = qt.quantize(model.eval(), data[0], data, progress=False, **options)
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    return lowered, said


def test_float_ops_between_quantize_dequantize_are_said_once_with_cause_and_fix() -> None:
    lowered, said = _quantize(FloatTail(), (64, 512))
    assert len(said) == 1
    (message,) = said
    assert "quantize/dequantize calls" in message and "aten.sin x4 in float" in message
    assert "activations=ActivationPoints.WEIGHTED_INPUTS" in message
    assert "speed_check=False" in message
    estimate = speed_of(lowered)
    assert estimate is not None and estimate.ratio >= CostModel().threshold
    assert {c.what for c in estimate.causes[:3]} == {"quantize/dequantize", "float op"}


def test_following_the_suggested_recipe_option_silences_it() -> None:
    quantizer = qt.Int8Quantizer(activations=qt.ActivationPoints.WEIGHTED_INPUTS)
    lowered, said = _quantize(FloatTail(), (64, 512), quantizer=quantizer)
    assert said == []
    estimate = speed_of(lowered)
    assert estimate is not None and estimate.ratio < CostModel().threshold
    assert not [c for c in estimate.causes if c.what == "quantize/dequantize"]


def test_a_fast_int8_conv_and_linear_model_is_silent() -> None:
    lowered, said = _quantize(ConvNet(), (2, 8, 16, 16))
    assert said == []
    estimate = speed_of(lowered)
    assert estimate is not None and estimate.ratio < 0.5


def test_the_documented_opt_out_silences_it_and_keeps_no_estimate() -> None:
    lowered, said = _quantize(FloatTail(), (64, 512), backend=cpu_backend(speed_check=False))
    assert said == []
    assert speed_of(lowered) is None


def test_the_reference_graph_is_not_checked() -> None:
    lowered, said = _quantize(FloatTail(), (64, 512), backend="reference")
    assert said == [] and speed_of(lowered) is None


def test_the_estimate_follows_an_injected_cost_model() -> None:
    """Deterministic by construction: the same graphs priced by two cost models, one where
    native calls cost a millisecond (so the conv model would be slower than float)."""
    data = [(torch.randn(2, 8, 16, 16),) for _ in range(2)]
    ref = qt.quantize(ConvNet().eval(), data[0], data, progress=False, backend="reference")
    lowered = qt.lower(ref, cpu_backend(speed_check=False))
    priced = price_float(ref)
    assert price_float(ref) == priced
    usual = price_lowered(lowered, priced)
    dear = CostModel(native_op_us=1000.0)
    assert price_lowered(lowered, price_float(ref, dear), dear).ratio > 1.0 > usual.ratio
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_speed(lowered, price_float(ref, dear), dear) is not None
        assert check_speed(lowered, priced) is not None
    assert [SAID in str(w.message) for w in caught] == [True]
    assert speed_of(lowered) == usual


def test_a_toy_model_is_priced_but_not_said() -> None:
    """Under ``min_float_us`` per-call constants alone decide the estimate: kept, unsaid."""
    lowered, said = _quantize(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (4, 8))
    estimate = speed_of(lowered)
    assert said == [] and estimate is not None
    assert estimate.float_us < CostModel().min_float_us
