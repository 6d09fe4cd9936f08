"""Observers: identity on their input, exact extremes, every dtype, statistics in state_dict."""

from __future__ import annotations

import pytest
import torch

import quantree as qt
from quantree.core.observing.kinds import make_observer

from support import batches, run

KINDS = list(qt.ObserverKind)


def _batches(n: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(4, 6, 3) * (i + 1) for i in range(n)]


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_identity_and_state_dict_round_trip(kind):
    spec = qt.QuantSpec(qt.QDtype.INT8, observer=kind)
    observer = make_observer(spec, "x")
    for x in _batches():
        assert observer(x) is x
    fresh = make_observer(spec, "x")
    fresh.load_state_dict(observer.state_dict())
    want, got = observer.qparams(), fresh.qparams()
    assert torch.equal(want.scale, got.scale) and torch.equal(want.zero_point, got.zero_point)


def test_min_max_is_exact_per_tensor_and_per_channel():
    data = _batches()
    stacked = torch.cat(data)
    per_tensor = make_observer(qt.QuantSpec(qt.QDtype.INT8), "x")
    per_channel = make_observer(qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=2), "w")
    for x in data:
        per_tensor(x)
        per_channel(x)
    assert per_tensor.min_val == stacked.min() and per_tensor.max_val == stacked.max()
    assert torch.equal(per_channel.min_val, stacked.amin(dim=(0, 1)))
    assert torch.equal(per_channel.max_val, stacked.amax(dim=(0, 1)))
    assert per_channel.qparams().scale.shape == (3,)


def test_per_channel_scales_round_to_eleven_significant_bits():
    """Per-channel scales are the min-max scale rounded to a float16 significand (so a
    saved file holds them in 2 bytes), within 2^-11 of it; per-tensor scales are exactly
    the range's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g) * torch.logspace(-4, 1, 64).unsqueeze(1)
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=0), "w")
    observer(w)
    exact = w.abs().amax(1) / 127.5
    scale = observer.qparams().scale
    assert bool(((scale / exact - 1).abs() <= 2**-11).all())
    mantissa, _ = torch.frexp(scale)
    assert torch.equal(torch.round(mantissa * 2**11), mantissa * 2**11)
    per_tensor = make_observer(qt.QuantSpec(qt.QDtype.INT8, symmetric=True), "x")
    per_tensor(w)
    assert per_tensor.qparams().scale == w.abs().max() / 127.5


def test_moving_average_lags_behind_a_growing_range():
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, observer=KINDS[1]), "x")
    data = _batches()
    for x in data:
        observer(x)
    assert data[0].max() < observer.max_val < torch.cat(data).max()


@pytest.mark.parametrize(
    ("dtype", "symmetric", "qrange"),
    [
        (qt.QDtype.UINT8, False, (0, 255)),
        (qt.QDtype.INT8, False, (-128, 127)),
        (qt.QDtype.INT16, True, (-32768, 32767)),
        (qt.QDtype.INT32, True, (-(2**31), 2**31 - 1)),
    ],
)
def test_every_dtype_covers_the_observed_range(dtype, symmetric, qrange):
    observer = make_observer(qt.QuantSpec(dtype, symmetric=symmetric), "x")
    x = torch.linspace(-3.0, 5.0, 101)
    observer(x)
    p = observer.qparams()
    assert (p.quant_min, p.quant_max) == qrange
    q = torch.clamp(torch.round(x / p.scale) + p.zero_point, *qrange)
    back = (q - p.zero_point) * p.scale
    assert (back - x).abs().max() <= p.scale / 2 + 1e-6  # nothing clipped
    if symmetric:
        assert int(p.zero_point) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_calibration_values_are_refused(bad):
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8), "linear_1")
    x = torch.randn(10)
    x[3] = bad
    with pytest.raises(qt.QuantreeError, match="linear_1"):
        observer(x)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_all_zero_tensors_calibrate_but_never_move_real_statistics(kind):
    """A zero initial state observed first, or between batches, leaves the range alone."""
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, observer=kind), "h")
    observer(torch.zeros(4, 8))
    assert observer.calibrated and float(observer.qparams().scale) <= 1e-6  # zeros only
    x = torch.linspace(-2.0, 3.0, 64)
    for _ in range(3):
        observer(torch.zeros(4, 8))
        observer(x)
    fresh = make_observer(qt.QuantSpec(qt.QDtype.INT8, observer=kind), "h")
    for _ in range(3):
        fresh(x)
    assert torch.equal(observer.min_val, fresh.min_val)
    assert torch.equal(observer.max_val, fresh.max_val)
    assert torch.equal(observer.qparams().scale, fresh.qparams().scale)


def test_moving_average_starts_at_the_first_batch_and_means_a_short_calibration():
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, observer=KINDS[1]), "x")
    observer(torch.tensor([-1.0, 1.0]))
    assert float(observer.max_val) == 1.0  # the first observation initialises
    observer(torch.tensor([-3.0, 3.0]))
    assert float(observer.max_val) == pytest.approx(2.0)  # mean of two, not 1% towards 3


def test_moving_average_counts_a_loop_batch_once():
    """Inside per_call (a cell loop's steps) the steps' extremes are one observation."""
    from quantree.core.observing.observers import per_call

    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, observer=KINDS[1]), "h")
    holder = torch.nn.Sequential(observer)
    for scale in (1.0, 3.0):
        with per_call(holder):
            for step in range(10):
                holder(torch.tensor([-scale, scale * (step + 1) / 10]))
    assert int(observer.num_averaged) == 2
    assert float(observer.max_val) == pytest.approx(2.0)


def test_an_all_zero_weight_channel_takes_the_other_channels_grid():
    """Zeros are exact on any grid; the floor scale is not, for the int32 bias derived from
    it (input scale x weight scale): it overflowed and was clamped."""
    w = torch.tensor([[0.0, 0.0], [0.5, -0.25], [0.0, 0.0]])
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=0), "w")
    observer(w)
    scale = observer.qparams().scale
    assert scale[0] == scale[1] == scale[2] and scale[1] > 0.0039  # 0.5 / 127.5 ~ 0.0039
    zeros = make_observer(qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=0), "w")
    zeros(torch.zeros(3, 2))
    assert torch.equal(zeros.qparams().scale, torch.ones(3))


def test_a_zero_weight_layer_keeps_its_large_bias():
    """xLSTM's gate projections start as zero weights and a -10 bias: the gate is the bias,
    which int32 at input scale x weight scale must hold (it was clamped to about -0.002)."""
    gate = torch.nn.Linear(8, 2)
    with torch.no_grad():
        gate.weight.zero_()
        gate.bias.fill_(-10.0)
    data = batches((4, 8))
    _, converted = run(gate.eval(), data)
    with torch.no_grad():
        got = converted(*data[0])
    assert torch.allclose(got, torch.full((4, 2), -10.0), atol=0.05)
