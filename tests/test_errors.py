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


class WithErf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.erf(self.a(x)))


def test_unknown_op_stays_float_and_is_named_in_one_warning():
    model = WithErf().eval()
    data = batches((4, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, ref = run(model, data)
    ours = [w for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    assert len(ours) == 1 and "aten.erf.default at erf" in str(ours[0].message)
    assert any(n.target is torch.ops.aten.erf.default for n in ref.graph.nodes)
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
    traced = torch.fx.symbolic_trace(WithErf())
    with pytest.raises(qt.QuantreeError, match=r"meta\['val'\].*quantree\.capture"):
        qt.prepare(traced, qt.Int8Quantizer())


def test_capture_needs_a_tuple_of_arguments():
    with pytest.raises(qt.QuantreeError, match=r"write \(x,\)"):
        qt.capture(WithErf(), torch.randn(2, 8))  # type: ignore[arg-type]


def _prepared_head(gm: torch.fx.GraphModule | None = None) -> torch.fx.GraphModule:
    gm = gm or qt.capture(WithErf().eval(), (torch.randn(4, 8),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        return qt.prepare(gm, qt.Int8Quantizer())


def test_calibration_batch_of_the_wrong_arity_names_it_and_the_fix():
    prepared, good = _prepared_head(), (torch.randn(4, 8),)
    with pytest.raises(qt.QuantreeError, match=r"batch 2 has 2 argument\(s\), the program takes 1"):
        qt.calibrate(prepared, [good, good, (torch.randn(4, 8), torch.randn(4))], progress=False)
    with pytest.raises(qt.QuantreeError, match=r"batch 0 has 0 argument\(s\), the program takes 1"):
        qt.calibrate(prepared, [()], progress=False)


def test_dataloader_of_input_target_pairs_gets_the_fix():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(8, 8), torch.randint(0, 4, (8,))), batch_size=4)
    fix = r"batch 0 has 2 argument\(s\), the program takes 1.*\[\(x,\) for x, _ in loader\]"
    with pytest.raises(qt.QuantreeError, match=fix):
        qt.calibrate(_prepared_head(), loader, progress=False)
    qt.calibrate(_prepared_head(), [(x,) for x, _ in loader], progress=False)


def test_calibration_batch_of_another_shape_suggests_dynamic_shapes():
    prepared = _prepared_head()
    other = (torch.randn(5, 8),)
    with pytest.raises(
        qt.QuantreeError, match=r"batch 1 .*x\.size\(\)\[0\] == 4.*dynamic_shapes="
    ) as caught:
        qt.calibrate(prepared, [(torch.randn(4, 8),), other], progress=False)
    assert isinstance(caught.value.__cause__, AssertionError)  # export's own guard, chained


def test_calibration_batch_of_the_wrong_dtype_or_rank_is_named():
    prepared = _prepared_head()
    with pytest.raises(qt.QuantreeError, match=r"batch 0 gives x as torch\.float64.*x\.to"):
        qt.calibrate(prepared, [(torch.randn(4, 8, dtype=torch.float64),)], progress=False)
    with pytest.raises(qt.QuantreeError, match=r"batch 0 gives x with shape \(4, 2, 8\)"):
        qt.calibrate(prepared, [(torch.randn(4, 2, 8),)], progress=False)
    with pytest.raises(qt.QuantreeError, match=r"batch 0 is a dict; .*\(args, kwargs\) pair"):
        qt.calibrate(prepared, [{"x": torch.randn(4, 8)}], progress=False)


def test_a_refused_batch_never_reaches_an_observer():
    """The graph's own guard runs after the input's observer; ours runs before anything."""
    data, gm = batches((4, 8), n=3), qt.capture(WithErf().eval(), (torch.randn(4, 8),))
    clean, refused = _prepared_head(gm), _prepared_head(gm)
    qt.calibrate(clean, data, progress=False)
    qt.calibrate(refused, data, progress=False)
    with pytest.raises(qt.QuantreeError, match="shape guard"):
        qt.calibrate(refused, [(100 * torch.randn(6, 8),)], progress=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(clean.state_dict().values(), refused.state_dict().values(), strict=True)
    )


def test_other_errors_keep_their_type_and_gain_the_batch_index():
    """Cells mode drops export's guard, so a wrong feature size fails inside an op."""
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    prepared = qt.prepare(gm, qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS))
    qt.calibrate(prepared, [(torch.randn(5, 4, 8),)], progress=False)  # any length and batch
    with pytest.raises(RuntimeError) as caught:
        qt.calibrate(prepared, [(torch.randn(3, 2, 8),), (torch.randn(3, 2, 6),)], progress=False)
    assert not isinstance(caught.value, qt.QuantreeError)
    assert "raised by calibration batch 1" in caught.value.__notes__
