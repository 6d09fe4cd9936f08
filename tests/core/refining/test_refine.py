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
from quantree.backends.onnx import onnx_session
from quantree.core.refining.refine import REFINED_KEY
from quantree.core.refining.rounding import output_error, round_against_output


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).flatten(1)
        return self.head(torch.relu(self.fc(y)))


def _setup(n: int = 16):
    torch.manual_seed(0)
    model = Net().eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 6, 6, generator=g),) for _ in range(n)]
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
    x = torch.randn(64, 3, 6, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(x)
        assert qt.sqnr(want, refined(x)) >= qt.sqnr(want, ref(x))
        lowered = qt.lower(refined, "cpu")
        assert qt.sqnr(refined(x), lowered(x)) >= 40.0
    pairs = zip(ref.state_dict().values(), refined.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_a_refined_graph_exports_to_onnx_as_any_reference_graph(tmp_path):
    pytest.importorskip("onnxruntime")
    _, prepared, ref, data = _setup()
    refined = qt.refine(prepared, ref, data)
    qt.export_onnx(refined, data[0], tmp_path / "refined.onnx")
    session = onnx_session(tmp_path / "refined.onnx")
    x = data[0][0]
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        assert torch.equal(torch.from_numpy(got), refined(x))


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


class Tagger(nn.Module):
    def __init__(self, cell: type[nn.Module], bidirectional: bool) -> None:
        super().__init__()
        self.rnn = cell(6, 8, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(16 if bidirectional else 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize(("cell", "bidirectional"), [(nn.LSTM, True), (nn.GRU, False)])
def test_recurrent_weight_matrices_are_refined_per_direction(cell, bidirectional):
    """Whole mode: each direction's W_ih and W_hh is rounded against its float rows' output
    on the inputs it reads (x; the previous hidden state), errors never rising, and the
    lowered model still matches the refined reference graph (>= 30 dB, native kernels)."""
    torch.manual_seed(0)
    model = Tagger(cell, bidirectional).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 10, 6, generator=g),) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    refined = qt.refine(prepared, qt.convert(prepared), data)
    rows = {r.node: r for r in refined.meta[REFINED_KEY]}
    op = "lstm" if cell is nn.LSTM else "gru"
    want = {f"{op} w_{w} dir {d}" for w in ("ih", "hh") for d in range(2 if bidirectional else 1)}
    assert want <= rows.keys()
    for name in want:
        assert rows[name].rounded and rows[name].error_after <= rows[name].error_before
        assert rows[name].bias_corrected == (op == "lstm" or "ih" in name)
    x = torch.randn(4, 10, 6, generator=g)
    with torch.no_grad():
        assert qt.sqnr(refined(x), qt.lower(refined, "cpu")(x)) >= 30.0


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


class Conv1dNet(nn.Module):
    """Pointwise, strided-padded and depthwise 1-d convolutions, as a Conformer's convolution
    module has them."""

    def __init__(self) -> None:
        super().__init__()
        self.point = nn.Conv1d(8, 16, 1)
        self.wide = nn.Conv1d(16, 16, 5, stride=2, padding=2, dilation=1)
        self.depth = nn.Conv1d(16, 16, 3, padding=1, groups=16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.depth(torch.relu(self.wide(torch.relu(self.point(x)))))


def test_1d_convolutions_are_refined_as_2d_ones_of_height_1():
    """Each conv1d's integers are rounded against its output, the depthwise one channel by
    channel (its error on calibration does not rise, the sum falls); on new
    inputs the refined model is at least as close to float (int16 activations, so the
    weights' rounding is what the output measures), and lowers (>= 40 dB)."""
    torch.manual_seed(0)
    model = Conv1dNet().eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, 40, generator=g),) for _ in range(16)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, data[0]), qt.A16W8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    refined = qt.refine(prepared, ref, data)
    rows = {r.node: r for r in refined.meta[REFINED_KEY]}
    assert set(rows) == {"conv1d", "conv1d_1", "conv1d_2"}
    names = ("conv1d", "conv1d_1", "conv1d_2")
    for name in names:
        assert rows[name].rounded and not rows[name].skipped
        assert rows[name].error_after <= rows[name].error_before
    assert sum(rows[n].error_after for n in names) < sum(rows[n].error_before for n in names)
    assert rows["conv1d_2"].error_after < rows["conv1d_2"].error_before
    x = torch.randn(32, 8, 40, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(x)
        assert qt.sqnr(want, refined(x)) >= qt.sqnr(want, ref(x))
        lowered = qt.lower(refined, "cpu")
        assert qt.sqnr(refined(x), lowered(x)) >= 40.0
