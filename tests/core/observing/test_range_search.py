"""ObserverKind.SEARCH: ranges chosen per point by the error they measure on held-out batches.

The thresholds (SQNR on new values from the calibration's distribution): on a small
calibration set the search gains >= 2 dB over min-max on average and loses <= 1 dB on any
draw; on a long-tailed tensor with plenty of data it clips, >= 2.5 dB above min-max; per
channel, no channel's error is ever above min-max's (min-max is one of the candidates and
the error is exact), and a heavy-tailed weight gains >= 1 dB.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import quantree as qt
from quantree.core.observing.channel_search import ChannelSearchObserver
from quantree.core.observing.kinds import make_observer
from quantree.core.observing.observers import per_call
from quantree.core.observing.qparams import fake_quantize
from quantree.core.observing.search import RangeSearchObserver

SEARCH = qt.ObserverKind.SEARCH


def _calibrated(kind: qt.ObserverKind, batches: list[torch.Tensor], symmetric: bool = False):
    observer = make_observer(qt.QuantSpec(qt.QDtype.INT8, symmetric=symmetric, observer=kind), "x")
    for x in batches:
        observer(x)
    return observer


def test_search_is_the_observer_of_its_kind_per_tensor_and_per_channel():
    assert isinstance(make_observer(qt.QuantSpec(observer=SEARCH), "x"), RangeSearchObserver)
    per_channel = qt.QuantSpec(symmetric=True, axis=0, observer=SEARCH)
    assert isinstance(make_observer(per_channel, "w"), ChannelSearchObserver)


def test_few_values_get_a_margin_that_holds_on_new_inputs():
    """800 values, as a linear head on a final state sees in 20 batches of 4: min-max clips
    new inputs' extremes. Over 8 draws the search takes the margin on most, gains >= 2 dB
    on new values on average and loses no more than 1 dB on any draw."""
    gains, choices = [], []
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        calibration = [torch.randn(40, generator=g) for _ in range(20)]
        new = torch.randn(20000, generator=g)
        search = _calibrated(SEARCH, calibration)
        minmax = _calibrated(qt.ObserverKind.MINMAX, calibration)
        searched, plain = search.qparams(), minmax.qparams()
        choices.append(search.choice)
        gains.append(float(qt.sqnr(new, fake_quantize(new, searched)))
                     - float(qt.sqnr(new, fake_quantize(new, plain))))  # fmt: skip
    assert choices.count("margin") >= 6, choices
    assert sum(gains) / len(gains) >= 2.0 and min(gains) >= -1.0, gains


def test_long_tails_seen_often_are_clipped():
    """A Student-t(3) tensor observed 200 000 times: its extremes are rare, so a clip wins,
    >= 2.5 dB over min-max on new values and level with the histogram's (within 0.1 dB)."""
    dist = torch.distributions.StudentT(3.0)
    torch.manual_seed(0)
    calibration = [dist.sample((10000,)) for _ in range(20)]
    new = dist.sample((100000,))
    search = _calibrated(SEARCH, calibration)
    got = {
        kind: float(qt.sqnr(new, fake_quantize(new, _calibrated(kind, calibration).qparams())))
        for kind in (qt.ObserverKind.MINMAX, qt.ObserverKind.HISTOGRAM)
    }
    searched = float(qt.sqnr(new, fake_quantize(new, search.qparams())))
    assert search.choice not in ("minmax", "margin")
    assert searched >= got[qt.ObserverKind.MINMAX] + 2.5, (searched, got)
    assert searched >= got[qt.ObserverKind.HISTOGRAM] - 0.1, (searched, got)


def test_one_batch_is_scored_on_itself():
    torch.manual_seed(0)
    observer = _calibrated(SEARCH, [torch.distributions.Laplace(0.0, 1.0).sample((50000,))])
    observer.qparams()
    assert observer.choice != "minmax"
    assert not bool(observer.odd.any())  # one batch: nothing held out


def test_a_loop_batch_takes_one_position_and_zeros_take_none():
    """Inside per_call (a cell loop) every step of one batch is on one side of the split; an
    all-zero tensor (a zero initial state) moves nothing."""
    observer = make_observer(qt.QuantSpec(observer=SEARCH), "h")
    holder = torch.nn.Sequential(observer)
    for scale in (1.0, 2.0, 3.0):
        holder(torch.zeros(8))
        with per_call(holder):
            for step in range(5):
                holder(torch.linspace(-scale, scale, 16) * (step + 1) / 5)
    assert int(observer.num_calls) == 3
    assert float(observer.odd.sum()) == 5 * 16  # the second batch's five steps


@pytest.mark.parametrize("symmetric", [False, True])
def test_state_dict_round_trip_gives_the_same_range_and_choice(symmetric):
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(64, generator=g).exp() * (1 + i % 3) for i in range(6)]
    observer = _calibrated(SEARCH, batches, symmetric)
    fresh = make_observer(observer.spec, "x")
    fresh.load_state_dict(observer.state_dict())
    want, got = observer.qparams(), fresh.qparams()
    assert torch.equal(want.scale, got.scale) and torch.equal(want.zero_point, got.zero_point)
    assert observer.choice == fresh.choice


@settings(max_examples=25, deadline=None)
@given(
    channels=st.integers(1, 12),
    width=st.integers(1, 40),
    tail=st.floats(0.0, 3.0),
    seed=st.integers(0, 2**16),
    axis=st.sampled_from([0, 1]),
)
def test_no_channel_errs_more_than_min_max(channels, width, tail, seed, axis):
    """Per channel the search takes the least exact error over clips, min-max among them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(channels, width, generator=g) * torch.rand(channels, 1, generator=g)
    w = w + tail * torch.randn(channels, width, generator=g) ** 3
    if axis == 1:
        w = w.t().contiguous()
    spec = qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=axis, quant_min=-127, quant_max=127)
    searched = make_observer(qt.QuantSpec(**{**spec.__dict__, "observer": SEARCH}), "w")
    minmax = make_observer(spec, "w")
    searched(w)
    minmax(w)

    def per_channel(p: qt.QParams) -> torch.Tensor:
        err = (fake_quantize(w, p) - w) ** 2
        return err.sum(dim=1 - axis)

    got, want = per_channel(searched.qparams()), per_channel(minmax.qparams())
    assert bool((got <= want).all())


def test_weight_search_clips_the_channels_of_a_wide_heavy_tailed_layer():
    """4096 weights a channel from a Student-t(3): most channels' least-error clip is inside
    their range, and the weight's SQNR rises (by > 0.05 dB: it is weights, not activations,
    and per channel, so little is left to gain)."""
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 4096))
    spec = qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=0, quant_min=-127, quant_max=127)
    searched = make_observer(qt.QuantSpec(**{**spec.__dict__, "observer": SEARCH}), "w")
    minmax = make_observer(spec, "w")
    searched(w)
    minmax(w)
    gain = float(qt.sqnr(w, fake_quantize(w, searched.qparams()))) - float(
        qt.sqnr(w, fake_quantize(w, minmax.qparams()))
    )
    assert gain > 0.05, gain
    assert int(searched.choice.split()[3]) >= 32, searched.choice  # "mse clip on N of 64 ..."


def test_the_recipe_takes_a_weight_observer_and_refuses_a_string():
    quantizer = qt.Int8Quantizer(activation_observer=SEARCH, weight_observer=SEARCH)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    prepared = qt.prepare(qt.capture(model, (x,)), quantizer)
    kinds = {type(m).__name__ for m in prepared.modules()}
    assert {"RangeSearchObserver", "ChannelSearchObserver"} <= kinds
    with pytest.raises(qt.QuantreeError, match="weight_observer must be an ObserverKind"):
        qt.Int8Quantizer(weight_observer="search")  # type: ignore[arg-type]
