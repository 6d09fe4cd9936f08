"""refine: weight integers rounded against the float layer's output, biases corrected.

Thresholds: per layer the output error on calibration never rises (exact: nearest rounding
is kept where error feedback does not beat it); on new inputs the refined model's SQNR is at
least the unrefined one's; the lowered refined model matches its reference graph (>= 40 dB).
"""

from __future__ import annotations

import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import quantree as qt
from quantree.core.refining.refine import REFINED_KEY
from quantree.core.refining.rounding import output_error, round_against_output


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).flatten(1)
        return self.head(torch.relu(self.fc(y)))


def _setup(n: int = 12):
    torch.manual_seed(0)
    model = Net().eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 8, 8, generator=g),) for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    return model, prepared, qt.convert(prepared), data


def test_refined_layers_err_less_and_the_model_holds_on_new_inputs():
    model, prepared, ref, data = _setup()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    refined = qt.refine(prepared, ref, data)
    rows = refined.meta[REFINED_KEY]
    assert [r.node for r in rows] == ["conv2d", "linear", "linear_1"]
    assert all(r.rounded and r.bias_corrected and not r.skipped for r in rows)
    assert all(r.error_after <= r.error_before for r in rows)
    assert sum(r.error_after for r in rows) < sum(r.error_before for r in rows)
    for key, value in ref.state_dict().items():  # the caller's graph is left alone
        assert torch.equal(value, before[key])
    x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(x)
        assert qt.sqnr(want, refined(x)) >= qt.sqnr(want, ref(x))
        lowered = qt.lower(refined, "cpu")
        assert qt.sqnr(refined(x), lowered(x)) >= 40.0
    pairs = zip(ref.state_dict().values(), refined.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_bias_correction_alone_moves_the_mean_output_error_towards_zero():
    model, prepared, ref, data = _setup()
    refined = qt.refine(prepared, ref, data, qt.Refine(rounding=False))
    x = torch.cat([b[0] for b in data])
    with torch.no_grad():
        want = model(x)
        shift = (want - ref(x)).mean(0).abs().sum()
        corrected = (want - refined(x)).mean(0).abs().sum()
    assert corrected < shift


def test_a_spent_budget_leaves_the_layers_as_convert_made_them():
    _, prepared, ref, data = _setup(2)
    refined = qt.refine(prepared, ref, data, qt.Refine(seconds=1e-9))
    assert {r.skipped for r in refined.meta[REFINED_KEY]} == {"time budget"}
    for a, b in zip(ref.state_dict().values(), refined.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_wrong_inputs_are_refused_with_the_fix_and_the_fix_works():
    model, prepared, ref, data = _setup(2)
    with pytest.raises(qt.QuantreeError, match=r"refine\(prepared, convert\(prepared\)"):
        qt.refine(ref, prepared, data)
    with pytest.raises(qt.QuantreeError, match="positive"):
        qt.Refine(seconds=0)
    with pytest.raises(qt.QuantreeError, match="not an iterator"):
        qt.quantize(model, data[0], iter(data), refine=qt.Refine(), backend=None, progress=False)
    got = qt.quantize(model, data[0], list(data), refine=qt.Refine(), backend=None, progress=False)
    assert len(got.meta[REFINED_KEY]) == 3


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 24),
    samples=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    correlated=st.booleans(),
)
def test_rounding_never_errs_more_than_nearest_and_stays_in_range(
    rows, cols, samples, seed, correlated
):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).double()
    x = torch.randn(samples, cols, generator=g).double()
    if correlated:
        x = x + x[:, :1]  # a shared component: where error feedback pays
    gram = x.t() @ x
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
    zero = torch.zeros(rows, 1, dtype=torch.float64)
    q = round_against_output(w, scale, zero, -127, 127, gram)
    assert torch.equal(q, torch.round(q)) and bool((q.abs() <= 127).all())
    nearest = torch.clamp(torch.round(w / scale), -127, 127)
    assert output_error(w - q * scale, gram) <= output_error(w - nearest * scale, gram)
