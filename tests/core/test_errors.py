"""Bad input gets quantree's own error naming the node and the fix; nothing is mutated."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.core.calibrate import BadBatch

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


def test_calibration_with_nan_names_the_batch_and_argument():
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    prepared = qt.prepare(gm, qt.Int8Quantizer())
    x = torch.randn(3, 2, 8)
    x[0, 0, 0] = float("nan")
    clean = (torch.randn(3, 2, 8),)
    with pytest.raises(BadBatch, match=r"batch 1 holds NaN or infinity in argument 0"):
        qt.calibrate(prepared, [clean, (x,)], progress=False)


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
    qt.quantize(model, data[0], data, progress=False, backend="reference")
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
    gm = gm or qt.capture(WithErf().eval(), (torch.randn(4, 8),), dynamic_batch=False)
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
    data, gm = (
        batches((4, 8), n=3),
        qt.capture(WithErf().eval(), (torch.randn(4, 8),), dynamic_batch=False),
    )
    clean, refused = _prepared_head(gm), _prepared_head(gm)
    qt.calibrate(clean, data, progress=False)
    qt.calibrate(refused, data, progress=False)
    with pytest.raises(qt.QuantreeError, match="shape guard"):
        qt.calibrate(refused, [(100 * torch.randn(6, 8),)], progress=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(clean.state_dict().values(), refused.state_dict().values(), strict=True)
    )


def test_a_wrong_feature_size_in_cells_mode_names_the_batch_and_dimension():
    """Cells mode drops export's guard, so a wrong feature size fails inside an op: the
    error names the batch and the dimension that differs from the captured example."""
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    prepared = qt.prepare(gm, qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS))
    qt.calibrate(prepared, [(torch.randn(5, 4, 8),)], progress=False)  # any length and batch
    with pytest.raises(BadBatch, match=r"batch 1 .*dimension 2 is 6, captured as 8") as caught:
        qt.calibrate(prepared, [(torch.randn(3, 2, 8),), (torch.randn(3, 2, 6),)], progress=False)
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_other_errors_keep_their_type_and_gain_the_batch_index():
    class Fails(nn.Module):
        def forward(self, x):
            return torch.nn.functional.linear(x, torch.ones(4, 8)) if x.shape[0] < 9 else x

    prepared = qt.prepare(qt.capture(Fails(), (torch.randn(3, 8),)), qt.Int8Quantizer())
    with pytest.raises(RuntimeError) as caught:
        prepared.forward = lambda x: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore
        qt.calibrate(prepared, [(torch.randn(3, 8),)], progress=False)
    assert not isinstance(caught.value, qt.QuantreeError)
    assert "raised by calibration batch 0" in caught.value.__notes__


aten = torch.ops.aten
ACT = qt.QuantSpec(qt.QDtype.INT8)


def _pool_rule(annotate) -> qt.Quantizer:
    return qt.Int8Quantizer(rules=(qt.Rule((aten.adaptive_avg_pool2d,), annotate),))


class ConvPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(self.conv(x), 1)


def _conv_pool() -> torch.fx.GraphModule:
    return qt.capture(ConvPool().eval(), (torch.randn(2, 3, 8, 8),))


def test_per_channel_axis_out_of_range_is_refused_at_prepare():
    spec = qt.QuantSpec(qt.QDtype.INT8, axis=5)
    quantizer = _pool_rule(lambda n: qt.Annotation(outputs=ACT, inputs={(0,): spec}))
    with pytest.raises(
        qt.QuantreeError, match=r"node adaptive_avg_pool2d .*axis 5 is out of range.*axis=None"
    ):
        qt.prepare(_conv_pool(), quantizer)


class AddColumn(nn.Module):
    def forward(self, x, y):
        return x + y  # [4, 8] + [4, 1]


def test_per_channel_group_of_tensors_with_different_channel_counts_is_refused_at_prepare():
    def add(node):
        x = qt.Use.of(node, (0,))
        inputs = {(0,): qt.QuantSpec(qt.QDtype.INT8, axis=1), (1,): qt.SharedSpec(x)}
        return qt.Annotation(outputs=ACT, inputs=inputs)

    gm = qt.capture(AddColumn(), (torch.randn(4, 8), torch.randn(4, 1)))
    with pytest.raises(
        qt.QuantreeError, match=r"node add .*add\.input\[1\].*8 channel\(s\) on axis 1.*has 1"
    ):
        qt.prepare(gm, qt.Quantizer([qt.Rule((aten.add.Tensor,), add)]))


def test_derived_bias_with_channels_of_another_axis_names_the_bias_at_convert():
    """Axis 0 of a transposed conv's weight is its input channels: 8 scales for 4 biases."""
    from core.test_sharing import UpConv, transposed_conv_rule

    data = batches((2, 8, 4, 4), n=2)
    prepared = qt.prepare(
        qt.capture(UpConv().eval(), data[0]), qt.Int8Quantizer(rules=(transposed_conv_rule(0),))
    )
    qt.calibrate(prepared, data, progress=False)
    with pytest.raises(qt.QuantreeError, match=r"node up_bias .*8 channel\(s\) on axis 0.*has 4"):
        qt.convert(prepared)


def test_annotation_input_path_that_does_not_exist_names_the_node_and_the_path():
    quantizer = _pool_rule(lambda n: qt.Annotation(outputs=ACT, inputs={(5,): ACT}))
    with pytest.raises(
        qt.QuantreeError, match=r"node adaptive_avg_pool2d .* no argument at path \[5\]"
    ):
        qt.prepare(_conv_pool(), quantizer)


@pytest.mark.parametrize(
    ("derive", "error"),
    [
        (lambda ps: None, r"returned NoneType, not QParams"),
        (lambda ps: ps[0], r"returned int8 parameters, but the spec declares int32"),
    ],
)
def test_derive_function_returning_the_wrong_thing_names_the_node(derive, error):
    def annotate(node):
        spec = qt.DerivedSpec((qt.Use.of(node, (0,)),), derive)
        return qt.Annotation(outputs=spec, inputs={(0,): ACT})

    data = batches((2, 3, 8, 8), n=2)
    prepared = qt.prepare(_conv_pool(), _pool_rule(annotate))
    qt.calibrate(prepared, data, progress=False)
    with pytest.raises(qt.QuantreeError, match=r"\(adaptive_avg_pool2d\) " + error):
        qt.convert(prepared)


class ConvBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_graph_captured_in_train_mode_is_refused_with_the_fix():
    model = ConvBatchNorm().train()
    x = torch.randn(2, 3, 8, 8)
    gm = torch.export.export(model, (x,)).module()  # not quantree.capture: stays in train mode
    with pytest.raises(
        qt.QuantreeError, match=r"node batch_norm \(aten\.batch_norm\.default\).*model\.eval\(\)"
    ):
        qt.prepare(gm, qt.Int8Quantizer())
    qt.prepare(qt.capture(model, (x,)), qt.Int8Quantizer())  # capture exports in eval mode
    assert model.training and model.bn.training


class Accumulates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        y = self.fc(x)
        self.acc.add_(y.detach().mean(0))
        return y + self.acc


def test_buffer_written_in_place_is_not_quantized_as_a_constant():
    model, data = Accumulates().eval(), batches((2, 4), n=3)
    gm = qt.capture(model, data[0])
    with pytest.raises(
        qt.QuantreeError, match=r"node add_ \(aten\.add_\.Tensor\) writes acc in place.*float"
    ):
        qt.prepare(gm, qt.Int8Quantizer())
    # Left in float, the buffer stays state: calibration and the converted model update
    # their own copies, never the captured graph's or the model's.
    float_add = qt.Rule((aten.add_.Tensor,), lambda n: qt.Annotation(outputs=ACT))
    prepared = qt.prepare(gm, qt.Int8Quantizer(rules=(float_add,)))
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    calibrated = prepared.acc.clone()
    with torch.no_grad():
        ref(*data[0])
        once = ref.acc.clone()
        ref(*data[0])
    assert not torch.equal(once, ref.acc) and not torch.equal(calibrated, torch.zeros(4))
    assert torch.equal(prepared.acc, calibrated)
    assert torch.equal(model.acc, torch.zeros(4)) and torch.equal(gm.acc, torch.zeros(4))


def _scope_warnings(gm: torch.fx.GraphModule, quantizer: qt.Quantizer) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qt.prepare(gm, quantizer)
    return [str(w.message) for w in caught if "matched the rule" in str(w.message)]


def test_a_scope_that_matches_no_node_is_named_with_the_scopes_where_its_ops_are():
    gm = qt.capture(LstmHead().eval(), (torch.randn(3, 2, 8),))
    cells = qt.RecurrentMode.CELLS
    (message,) = _scope_warnings(gm, qt.Int8Quantizer(recurrent=cells, cells_scope="nope"))
    assert "scope 'nope'" in message and "aten.lstm.input" in message
    assert "occur in scopes 'lstm'" in message
    wide = qt.Rule((aten.linear,), lambda n: qt.Annotation(outputs=ACT), scope="head")
    (message,) = _scope_warnings(gm, qt.Int8Quantizer(rules=(wide,)))
    assert "scope 'head'" in message and "occur in scopes 'fc'" in message
    # A scope that applies (its GRU-only point rules match nothing) and unscoped rules: quiet.
    assert not _scope_warnings(gm, qt.Int8Quantizer(recurrent=cells, cells_scope="lstm"))
    assert not _scope_warnings(gm, qt.Int8Quantizer(recurrent=cells))


class DeadRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.a.bias.fill_(-100.0)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _vanishing_warnings(model: nn.Module, data: list, quantizer: qt.Quantizer) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, data, quantizer)
    return [str(w.message) for w in caught if "vanishing range" in str(w.message)]


def test_groups_whose_calibrated_range_vanished_are_named_in_one_warning():
    data = batches((4, 8), n=4)
    (message,) = _vanishing_warnings(DeadRelu().eval(), data, qt.Int8Quantizer())
    assert "group 0 (relu, linear_1.input[0])" in message and "representative data" in message
    zeros = [(torch.zeros(4, 8),)] * 3
    (message,) = _vanishing_warnings(WithErf().eval(), zeros, qt.Int8Quantizer())
    assert "linear.input[0]" in message
    assert not _vanishing_warnings(WithErf().eval(), data, qt.Int8Quantizer())


class ZeroStart(nn.Module):
    """A decoder whose first frame and initial state are zeros made inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.cell = nn.Linear(8, 8, bias=False), nn.LSTMCell(16, 8)

    def forward(self, memory: torch.Tensor) -> torch.Tensor:
        h = memory.new_zeros(memory.shape[0], 8)
        c = torch.zeros(memory.shape[0], 8)
        frame = torch.zeros(memory.shape[0], 8)
        outs = []
        for t in range(3):
            step = torch.cat([torch.relu(self.pre(frame)), memory[:, t]], 1)
            h, c = self.cell(step, (h, c))
            frame = h
            outs.append(h)
        return torch.stack(outs, 1)


def test_exact_zeros_computed_from_no_input_are_not_named_as_vanishing():
    data = batches((2, 3, 8), n=4)
    assert not _vanishing_warnings(ZeroStart().eval(), data, qt.Int8Quantizer())
    zeros = [(torch.zeros(2, 3, 8),)] * 2  # zeros fed as calibration data: still named
    (message,) = _vanishing_warnings(ZeroStart().eval(), zeros, qt.Int8Quantizer())
    assert "representative data" in message


def test_vanishing_ranges_of_every_cell_body_share_one_warning():
    lstm = nn.LSTM(8, 8, bidirectional=True).eval()
    zeros = [(torch.zeros(3, 2, 8),)] * 2
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    (message,) = _vanishing_warnings(lstm, zeros, quantizer)
    assert "lstm_cells.loops.l0.body group" in message
    assert "lstm_cells.loops.l0_reverse.body group" in message


@pytest.mark.parametrize("mode", [qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS])
def test_each_step_refuses_the_output_of_the_wrong_step(mode):
    """prepare(prepared), convert(converted), lower(prepared) once ran silently (a float
    "lowered" model, a cells-mode prepared model rewritten in place)."""
    torch.manual_seed(0)
    model = nn.LSTM(4, 8).eval()
    data = batches((3, 2, 4), n=2)
    quantizer = qt.Int8Quantizer(recurrent=mode)
    prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
    qt.calibrate(prepared, data, progress=False)
    with pytest.raises(qt.QuantreeError, match="prepare got a prepared model"):
        qt.prepare(prepared, quantizer)
    with pytest.raises(qt.QuantreeError, match="lower expects the output of quantree"):
        qt.lower(prepared, CPU)
    converted = qt.convert(prepared)  # the refused calls left `prepared` as it was
    with pytest.raises(qt.QuantreeError, match="got a converted model"):
        qt.convert(converted)
    with pytest.raises(qt.QuantreeError, match="prepare got a converted model"):
        qt.prepare(converted, quantizer)
