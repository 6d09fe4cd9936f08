"""Sharing, derived and fixed specs, nested custom-op outputs, observers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.grouping.sharing import compatible
from quantree.core.specs import int8_activation, int8_weight

from support import (
    DEQUANTIZE,
    QUANTIZE,
    assert_prepared_exact,
    batches,
    calls,
    output_sqnrs,
    qd,
    qparams_of,
    run,
)


@torch.library.custom_op("quantree_test::cell", mutates_args=())
def cell(
    x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    c_new = 0.5 * c + torch.tanh(x)
    h_new = torch.tanh(c_new) * torch.sigmoid(h)
    return h_new * 3.0, [h_new.clone(), c_new * 100.0]


@cell.register_fake
def _(x, h, c):
    return torch.empty_like(x), [torch.empty_like(h), torch.empty_like(c)]


class UsesCell(nn.Module):
    def forward(self, x, h, c):
        out, (h, c) = cell(x, h, c)
        return out + 1.0, h * 2.0, c - 1.0


def test_custom_op_nested_output_gets_one_observer_per_leaf_and_its_dtypes():
    specs = (
        qt.QuantSpec(qt.QDtype.INT8),
        (qt.QuantSpec(qt.QDtype.UINT8), qt.QuantSpec(qt.QDtype.INT16, symmetric=True)),
    )
    rule = qt.Rule((torch.ops.quantree_test.cell,), lambda n: qt.Annotation(outputs=specs))
    data = batches((4, 8), (4, 8), (4, 8))
    model = UsesCell()
    prepared, ref = run(model, data, qt.Quantizer([rule]))
    assert_prepared_exact(model, prepared, data[0])
    observers = {
        n.target
        for n in prepared.graph.nodes
        if n.op == "call_module" and n.target.startswith("observer_")
    }
    assert len(observers) == 3
    (node,) = calls(ref, torch.ops.quantree_test.cell.default)
    dtypes = {}
    for q in calls(ref, qd.quantize_per_tensor.default):
        leaf = qt.Value.of(q.args[0])
        if leaf.node is node:
            dtypes[leaf.path] = q.args[5]
    assert dtypes == {(0,): torch.int8, (1, 0): torch.uint8, (1, 1): torch.int16}
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


class ChainedCats(nn.Module):
    def forward(self, a, b, c):
        return torch.cat([torch.cat([a, b * 2.0], 1), c], 1)


def test_chained_cats_share_one_set_of_parameters():
    data = batches((3, 4), (3, 4), (3, 4))
    prepared, ref = run(ChainedCats(), data)
    assert_prepared_exact(ChainedCats(), prepared, data[0])
    params = {qparams_of(n) for n in calls(ref, qd.quantize_per_tensor.default)}
    cats = calls(ref, torch.ops.aten.cat.default)
    touching = set()
    for cat in cats:
        for arg in cat.args[0]:
            touching.add(qparams_of(arg))
        (q,) = [u for u in cat.users if u.target in QUANTIZE]
        touching.add(qparams_of(q))
    assert len(touching) == 1
    assert len(params) >= 1


class LinearSigmoid(nn.Module):
    def __init__(self, per_channel_bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        return torch.sigmoid(self.fc(x)), torch.tanh(x)


def _bias_check(ref):
    """Bias scale == float32(input scale x weight scale), the product taken in float64."""
    (linear,) = calls(ref, torch.ops.aten.linear.default)
    x_dq, w_dq, b_dq = linear.args
    x_scale = torch.tensor(float(x_dq.args[1]), dtype=torch.float64)
    if w_dq.target is qd.dequantize_per_channel.default:
        w_scale = getattr(ref, w_dq.args[1].target).double()
        b_scale = getattr(ref, b_dq.args[1].target)
        assert b_dq.args[6] == torch.int32
    else:
        w_scale = torch.tensor(float(w_dq.args[1]), dtype=torch.float64)
        b_scale = torch.tensor(float(b_dq.args[1]))
        assert b_dq.args[5] == torch.int32
    assert torch.equal(b_scale, (x_scale * w_scale).float())


def test_derived_bias_scale_is_input_times_weight_per_channel_and_per_tensor():
    data = batches((4, 6))
    for per_channel in (True, False):
        _, ref = run(LinearSigmoid(), data, qt.Int8Quantizer(per_channel=per_channel))
        _bias_check(ref)


def test_fixed_parameters_reach_the_converted_graph_unchanged():
    data = batches((4, 6))
    _, ref = run(LinearSigmoid(), data)
    (sig,) = calls(ref, torch.ops.aten.sigmoid.default)
    (q,) = sig.users
    assert qparams_of(q) == (1.0 / 256.0, -128, torch.int8)
    (tanh,) = calls(ref, torch.ops.aten.tanh.default)
    (q,) = tanh.users
    assert qparams_of(q) == (1.0 / 128.0, 0, torch.int8)


def test_explicit_shared_spec_is_transitive():
    def rule(node):
        a, b = qt.Use.of(node, (0,)), qt.Use.of(node, (1,))
        return qt.Annotation(
            outputs=qt.SharedSpec(b), inputs={(0,): qt.QuantSpec(), (1,): qt.SharedSpec(a)}
        )

    class Add(nn.Module):
        def forward(self, x, y):
            return x + 10.0 * y

    data = batches((4, 4), (4, 4))
    _, ref = run(Add(), data, qt.Quantizer([qt.Rule((torch.ops.aten.add.Tensor,), rule)]))
    (add,) = calls(ref, torch.ops.aten.add.Tensor)
    (q,) = add.users
    seen = {qparams_of(add.args[0]), qparams_of(add.args[1]), qparams_of(q)}
    assert len(seen) == 1
    assert all(a.target in DEQUANTIZE for a in add.args)


def test_observer_state_dict_round_trip():
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    data = batches((4, 6))
    quantizer = qt.Int8Quantizer(activation_observer=qt.ObserverKind.HISTOGRAM)
    prepared, ref = run(model, data, quantizer)
    fresh = qt.prepare(qt.capture(model, data[0]), quantizer)
    fresh.load_state_dict(prepared.state_dict())
    ref2 = qt.convert(fresh)
    with torch.no_grad():
        assert torch.equal(ref(*data[0]), ref2(*data[0]))


def test_histogram_observer_clips_outliers_better_than_minmax():
    x = torch.randn(10000)
    x[0] = 60.0
    spec = qt.QuantSpec(observer=qt.ObserverKind.HISTOGRAM)
    hist, minmax = qt.HistogramObserver(spec, "h"), qt.MinMaxObserver(spec, "m")
    hist(x), minmax(x)
    from quantree.core.observing.qparams import fake_quantize

    err_h = (fake_quantize(x, hist.qparams()) - x).pow(2).mean()
    err_m = (fake_quantize(x, minmax.qparams()) - x).pow(2).mean()
    assert err_h < err_m


class CatOfSigmoid(nn.Module):
    """``y`` spans about [-6, 6]; the sigmoid beside it in the cat has the fixed [0, 1) grid."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x) * 5.0
        return torch.cat([torch.sigmoid(y), y], dim=1)


def test_implicit_sharing_never_puts_a_wider_value_on_a_fixed_grid():
    data = batches((8, 16))
    model = CatOfSigmoid().eval()
    _, ref = run(model, data)
    (sig,) = calls(ref, torch.ops.aten.sigmoid.default)
    (q,) = sig.users
    assert qparams_of(q) == (1.0 / 256.0, -128, torch.int8)  # the sigmoid keeps its own grid
    (cat,) = calls(ref, torch.ops.aten.cat.default)
    (q_cat,) = [u for u in cat.users if u.target in QUANTIZE]
    assert qparams_of(q_cat)[0] > 8.0 / 256.0  # the cat covers y's range: sigmoid requantized
    assert min(output_sqnrs(model, ref, data[0])) >= 30.0


def test_explicit_shared_spec_still_joins_a_fixed_group():
    def cat(node):
        pieces = node.args[0]
        fixed = qt.SharedSpec(qt.Value.of(pieces[0]))
        inputs = {(0, i): qt.SharedSpec(qt.Value(node)) for i in range(len(pieces))}
        return qt.Annotation(outputs=fixed, inputs=inputs)

    rule = qt.Rule((torch.ops.aten.cat.default,), cat)
    _, ref = run(CatOfSigmoid().eval(), batches((8, 16)), qt.Int8Quantizer(rules=(rule,)))
    (cat_node,) = calls(ref, torch.ops.aten.cat.default)
    (q_cat,) = [u for u in cat_node.users if u.target in QUANTIZE]
    assert qparams_of(q_cat) == (1.0 / 256.0, -128, torch.int8)


class TanhInitialState(nn.Module):
    """An LSTM whose c0 = tanh(...) and whose forget gate keeps |c| growing well past 1."""

    def __init__(self) -> None:
        super().__init__()
        self.init_h, self.init_c = nn.Linear(8, 16), nn.Linear(8, 16)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        with torch.no_grad():
            self.lstm.bias_ih_l0[16:32] += 3.0
            self.lstm.bias_ih_l0[32:48] += 1.0

    def forward(self, z, x):
        h0 = torch.tanh(self.init_h(z.unsqueeze(0)))
        c0 = torch.tanh(self.init_c(z.unsqueeze(0)))
        out, (h, c) = self.lstm(x, (h0, c0))
        return out, h, c


class TanhInitialCellLoop(nn.Module):
    """The same with an ``nn.LSTMCell`` loop: each step's c shares the incoming c's group."""

    def __init__(self) -> None:
        super().__init__()
        self.init_c, self.cell = nn.Linear(8, 16), nn.LSTMCell(8, 16)
        with torch.no_grad():
            self.cell.bias_ih[16:32] += 3.0
            self.cell.bias_ih[32:48] += 1.0

    def forward(self, z, x):
        h = torch.zeros(z.shape[0], 16)
        c = torch.tanh(self.init_c(z))
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return h, c


@pytest.mark.parametrize("cls", [TanhInitialState, TanhInitialCellLoop])
def test_state_initialised_by_tanh_is_not_clipped_to_its_fixed_grid(cls):
    torch.manual_seed(0)
    model = cls().eval()
    data = batches((4, 8), (4, 12, 8), n=8)
    _, ref = run(model, data)
    with torch.no_grad():
        c_float, c_quant = model(*data[0])[-1], ref(*data[0])[-1]
    assert c_float.abs().max() > 2.0
    assert qt.sqnr(c_float, c_quant) >= 30.0


class LinearOfComputedWeight(nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.linear(x, torch.relu(w))


def test_implicit_sharing_needs_the_same_scheme_not_just_the_dtype():
    assert not compatible(int8_weight(0), int8_activation())
    assert not compatible(int8_weight(None), int8_activation())
    assert compatible(qt.FixedSpec(1 / 128, 0), qt.QuantSpec(symmetric=True))
    assert not compatible(qt.FixedSpec(1 / 256, -128), qt.QuantSpec(symmetric=True))
    assert compatible(qt.FixedSpec(1 / 256, -128), int8_activation())

    data = batches((4, 6), (5, 6))
    _, ref = run(LinearOfComputedWeight(), data)
    (linear,) = calls(ref, torch.ops.aten.linear.default)
    assert linear.args[1].target is qd.dequantize_per_channel.default  # requantized per channel


class UpConv(nn.Module):
    """A transposed conv keeps its output channels on the weight's axis 1: [in, out, kh, kw]."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        return self.up(x)


def transposed_conv_rule(axis: int) -> qt.Rule:
    weight = qt.QuantSpec(qt.QDtype.INT8, symmetric=True, axis=axis, quant_min=-127, quant_max=127)

    def annotate(node):
        x, w = qt.Use.of(node, (0,)), qt.Use.of(node, (1,))
        inputs = {(0,): int8_activation(), (1,): weight, (2,): qt.bias_spec(x, w)}
        return qt.Annotation(outputs=int8_activation(), inputs=inputs)

    return qt.Rule((torch.ops.aten.conv_transpose2d,), annotate)


def test_product_of_scales_puts_a_bias_on_its_only_axis():
    from quantree.core.specs import product_of_scales

    x = qt.QParams(torch.tensor(0.5), torch.tensor(0), qt.QDtype.INT8, -128, 127)
    w = qt.QParams(torch.full((4,), 0.25), torch.zeros(4, dtype=torch.int64), qt.QDtype.INT8,
                   -127, 127, axis=1)  # fmt: skip
    bias = product_of_scales([x, w])
    assert bias.axis == 0 and torch.equal(bias.scale, torch.full((4,), 0.125))
    assert product_of_scales([x, x]).axis is None


def test_derived_bias_of_a_weight_per_channel_on_axis_1_is_per_channel_on_axis_0():
    torch.manual_seed(0)
    model, data = UpConv().eval(), batches((2, 8, 4, 4), n=8)
    _, ref = run(model, data, qt.Int8Quantizer(rules=(transposed_conv_rule(1),)))
    (conv,) = calls(ref, torch.ops.aten.conv_transpose2d.input)
    x_dq, w_dq, b_dq = conv.args[:3]
    assert w_dq.args[3] == 1 and b_dq.args[3] == 0  # the axis of each dequantize
    w_scale = getattr(ref, w_dq.args[1].target).double()
    b_scale = getattr(ref, b_dq.args[1].target)
    assert b_scale.shape == (4,)
    assert torch.equal(b_scale, (float(x_dq.args[1]) * w_scale).float())
    assert min(output_sqnrs(model, ref, data[0])) >= 30.0
