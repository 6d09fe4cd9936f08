"""mixed_precision: the fewest points widened to meet an output SQNR, measured on held-out
batches; the result lowers and saves, the model is untouched."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import quantree as qt
from quantree.backends.cpu.saved.serialize import load, save
from quantree.recipes.mixed import PointKey, Precision
from quantree.tools.mixed_precision import META_KEY, TargetUnreachable, mixed_precision

ADD = PointKey("", "add")


class Outlier(torch.nn.Module):
    """``add`` carries one channel at 300 that the head ignores: at int8 its step buries
    every other channel, at int16 it does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)
        bump = torch.zeros(16)
        bump[3] = 300.0
        self.register_buffer("bump", bump)
        with torch.no_grad():
            self.c.weight[:, 3] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(self.b(h) + self.bump)


def batches() -> list[tuple[torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(4, 8),) for _ in range(8)]


def test_the_bad_point_alone_is_widened_and_the_result_lowers_and_saves(tmp_path):
    model, data = Outlier(), batches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = mixed_precision(model, data[0], data, target_sqnr=20.0)
    assert result.quantized_db < 10.0  # the outlier ruins int8
    assert result.widened == ((ADD, Precision.INT16),)
    assert result.reached_db >= 20.0
    assert result.ranking[0].point == ADD
    assert result.ranking[0].cost_db > 15.0
    assert all(c.cost_db < 1.0 for c in result.ranking[1:])
    assert (result.calibration_batches, result.held_out_batches) == (6, 2)
    assert result.reference.meta[META_KEY] is result
    assert "add: int16" in result.render()
    for k, v in model.state_dict().items():  # nothing mutated
        assert torch.equal(v, before[k])
    # what was reported is what the reference graph gives on the held-out batches
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in data[6:]])
        got = torch.cat([result.reference(*b) for b in data[6:]])
    assert qt.sqnr(ref, got) >= 20.0
    lowered = qt.lower(result.reference, "cpu")
    with torch.no_grad():
        low = torch.cat([lowered(*b) for b in data[6:]])
    assert qt.sqnr(ref, low) >= 20.0
    path = tmp_path / "mixed.pt2"
    save(lowered, path, data[0])
    with torch.no_grad():
        assert torch.equal(load(path)(*data[6]), lowered(*data[6]))


def test_a_target_already_met_widens_nothing():
    data = batches()
    result = mixed_precision(Outlier(), data[0], data, target_sqnr=0.0)
    assert result.widened == () and result.ranking == ()
    assert result.reached_db == result.quantized_db and result.trials == 1


def test_an_unreachable_target_names_the_best_and_the_fix_it_suggests_works():
    data = batches()
    with pytest.raises(TargetUnreachable, match="allow_float=True") as caught:
        mixed_precision(Outlier(), data[0], data, target_sqnr=200.0, allow_float=False)
    assert "200.0 dB" in str(caught.value)
    # following it: float points reach what int16 cannot (all float is the float model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mixed_precision(Outlier(), data[0], data, target_sqnr=200.0)
    assert result.reached_db >= 200.0
    assert {p for _, p in result.widened} == {Precision.FLOAT}
    assert math.isinf(result.reached_db) or result.reached_db >= 200.0
    # the CPU backend keeps the float points float, saying so once
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        qt.lower(result.reference, "cpu")
    messages = [str(w.message) for w in caught_warnings]
    assert len(messages) == 1 and "compute in float" in messages[0]


@pytest.mark.parametrize("held_out", [0, 8])
def test_held_out_must_leave_batches_to_calibrate_and_to_measure(held_out):
    data = batches()
    with pytest.raises(qt.QuantreeError, match="held_out"):
        mixed_precision(Outlier(), data[0], data, target_sqnr=30.0, held_out=held_out)


def test_quantize_with_a_target_sqnr_lowers_the_chosen_points():
    data = batches()
    lowered = qt.quantize(Outlier(), data[0], data, target_sqnr=20.0, backend="cpu")
    result = lowered.meta[META_KEY]
    assert result.widened == ((ADD, Precision.INT16),)
    with torch.no_grad():
        ref = torch.cat([Outlier()(*b) for b in data[6:]])
        low = torch.cat([lowered(*b) for b in data[6:]])
    assert qt.sqnr(ref, low) >= 20.0
    with pytest.raises(qt.QuantreeError, match=r"quantree\.mixed_precision"):
        qt.quantize(Outlier(), data[0], data, target_sqnr=20.0, refine=qt.Refine())
