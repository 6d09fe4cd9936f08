"""Bad input gets quantree's own error naming the node and the fix; nothing is mutated."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import quantree as qt

from support import batches, output_sqnrs, run


class LstmHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.lstm(x)[0])


def test_output_spec_that_does_not_match_the_output_structure():
    bad = qt.Rule((torch.ops.aten.lstm,), lambda n: qt.Annotation(outputs=(qt.QuantSpec(),) * 2))
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    with pytest.raises(
        qt.QuantreeError, match=r"node lstm \(aten\.lstm\.input\).*shape the output"
    ):
        qt.prepare(gm, qt.Int8Quantizer() + qt.Quantizer([bad]))


def test_sharing_group_that_mixes_dtypes():
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    mixed = qt.Rule(
        (torch.ops.aten.linear,),
        lambda n: qt.Annotation(
            outputs=qt.SharedSpec(qt.Use.of(n, (0,)), dtype=qt.QDtype.INT8),
            inputs={(0,): qt.QuantSpec(qt.QDtype.INT16, symmetric=True)},
        ),
    )
    with pytest.raises(qt.QuantreeError, match=r"mixes dtypes \(linear.*int8.*int16"):
        qt.prepare(gm, qt.Quantizer([mixed]))
    agreeing = qt.Rule(
        (torch.ops.aten.linear,),
        lambda n: qt.Annotation(
            outputs=qt.SharedSpec(qt.Use.of(n, (0,)), dtype=qt.QDtype.INT16),
            inputs={(0,): qt.QuantSpec(qt.QDtype.INT16, symmetric=True)},
        ),
    )
    qt.prepare(gm, qt.Quantizer([agreeing]))


def test_convert_before_calibration():
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    prepared = qt.prepare(gm, qt.Int8Quantizer())
    with pytest.raises(qt.QuantreeError, match=r"never observed.*calibrat"):
        qt.convert(prepared)


def test_calibration_with_nan_names_the_node():
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    prepared = qt.prepare(gm, qt.Int8Quantizer())
    x = torch.randn(3, 2, 8)
    x[0, 0, 0] = float("nan")
    with pytest.raises(qt.QuantreeError, match=r"NaN.*(x|lstm).*remove non-finite"):
        qt.calibrate(prepared, [(x,)], progress=False)


def test_convert_needs_a_prepared_model():
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    with pytest.raises(qt.QuantreeError, match=r"output of quantree\.prepare"):
        qt.convert(gm)


class WithGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x)))


def test_unknown_op_stays_float_and_is_named_in_one_warning():
    model = WithGelu().eval()
    data = batches((4, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, ref = run(model, data)
    ours = [w for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    assert len(ours) == 1 and "aten.gelu.default at gelu" in str(ours[0].message)
    assert any(n.target is torch.ops.aten.gelu.default for n in ref.graph.nodes)
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


def test_user_model_and_captured_graph_are_never_mutated():
    model = LstmHead().eval()
    before = copy.deepcopy(model.state_dict())
    data = batches((3, 2, 8))
    gm = qt.capture(model, data[0])
    code_before = gm.code
    prepared = qt.prepare(gm, qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    prepared_code = prepared.code
    qt.convert(prepared)
    qt.quantize(model, data[0], data, progress=False)
    assert gm.code == code_before and prepared.code == prepared_code
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert not model.training


def test_bad_spec_values_fail_at_construction():
    with pytest.raises(qt.QuantreeError):
        qt.QuantSpec(qt.QDtype.INT8, quant_min=-300)
    with pytest.raises(qt.QuantreeError):
        qt.FixedSpec(-1.0, 0)
    with pytest.raises(qt.QuantreeError):
        qt.QuantSpec("int8")  # type: ignore[arg-type]


def test_symbolically_traced_graph_is_refused_with_the_fix():
    traced = torch.fx.symbolic_trace(WithGelu())
    with pytest.raises(qt.QuantreeError, match=r"meta\['val'\].*quantree\.capture"):
        qt.prepare(traced, qt.Int8Quantizer())


def test_capture_needs_a_tuple_of_arguments():
    with pytest.raises(qt.QuantreeError, match=r"write \(x,\)"):
        qt.capture(WithGelu(), torch.randn(2, 8))  # type: ignore[arg-type]
