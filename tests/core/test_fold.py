"""Folding before annotation: parameter-only computations and eval-mode batch norm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.core.graphs import copy_graph_module
from quantree.core.normalizing.fold import fold_batch_norm, fold_constants, written_to

from support import assert_prepared_exact, batches, calls, output_sqnrs, qd, run

aten = torch.ops.aten


class ChunkedWeight(nn.Module):
    """Two linears whose weights and biases are pieces of one parameter each (fused QKV)."""

    def __init__(self) -> None:
        super().__init__()
        rows = torch.logspace(-2, 0, 64)[:, None]  # rows of very different scale
        self.w = nn.Parameter(torch.randn(64, 32) * rows)
        self.b = nn.Parameter(torch.randn(64))

    def forward(self, x):
        wq, wk = self.w.chunk(2)
        bq, bk = self.b.split([32, 32])
        return F.linear(x, wq, bq), F.linear(x, wk, bk)


def _weight_and_bias_are_integer_constants(ref: torch.fx.GraphModule, linears: int) -> None:
    nodes = calls(ref, aten.linear.default)
    assert len(nodes) == linears
    for linear in nodes:
        w_dq, b_dq = linear.args[1], linear.args[2]
        assert w_dq.target is qd.dequantize_per_channel.default
        assert w_dq.args[0].op == "get_attr"  # quantized once by convert
        assert getattr(ref, w_dq.args[0].target).dtype == torch.int8
        assert b_dq.args[0].op == "get_attr"
        assert getattr(ref, b_dq.args[0].target).dtype == torch.int32


def test_weights_split_from_one_parameter_are_per_channel_constants():
    torch.manual_seed(0)
    model = ChunkedWeight().eval()
    data = batches((16, 32), n=8)
    prepared, ref = run(model, data)
    assert not calls(prepared, aten.chunk.default)
    assert not calls(prepared, aten.split_with_sizes.default)
    assert_prepared_exact(model, prepared, data[0])
    _weight_and_bias_are_integer_constants(ref, linears=2)
    # on a calibration batch: the default's range search may clip what min-max would cover
    assert min(output_sqnrs(model, ref, data[0])) >= 29.5


class CrossAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, query, memory):
        return self.attention(query, memory, memory, need_weights=False)[0]


def test_cross_attention_in_projection_gets_per_channel_weights():
    """query != key splits ``in_proj_weight`` into the q and the kv projections."""
    torch.manual_seed(0)
    model = CrossAttention().eval()
    data = batches((2, 5, 16), (2, 7, 16), n=8)
    _, ref = run(model, data)
    _weight_and_bias_are_integer_constants(ref, linears=3)
    assert min(output_sqnrs(model, ref, data[0])) >= 30.0


class WritesParameterView(nn.Module):
    """In-place writes into fresh tensors made from parameters alone."""

    def __init__(self, read_before_write: bool = False, write_input: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.read_before_write, self.write_input = read_before_write, write_input

    def forward(self, x):
        row = (self.w * 2.0)[0]
        early = x * row if self.read_before_write else x
        row.add_(x.sum() if self.write_input else 1.0)  # a fresh tensor, written every call
        return early + row


def test_tensors_written_in_place_keep_running_when_a_read_or_the_write_needs_the_input():
    for kwargs in ({"read_before_write": True}, {"write_input": True}):
        model = WritesParameterView(**kwargs).eval()
        x = torch.randn(2, 4)
        gm = fold_constants(copy_graph_module(qt.capture(model, (x,))))
        assert calls(gm, aten.mul.Tensor) and calls(gm, aten.add_.Tensor), kwargs
        with torch.no_grad():
            assert torch.equal(gm(x), model(x)) and torch.equal(gm(x), model(x))


def test_writes_into_a_fresh_tensor_before_any_read_fold_once():
    model = WritesParameterView().eval()
    x = torch.randn(2, 4)
    gm = fold_constants(copy_graph_module(qt.capture(model, (x,))))
    assert not calls(gm, aten.add_.Tensor) and not calls(gm, aten.mul.Tensor)
    with torch.no_grad():  # the write happened once, at folding: calls do not accumulate
        assert torch.equal(gm(x), model(x)) and torch.equal(gm(x), model(x))


class SwinV2Attention(nn.Module):
    """torchvision's Swin V2 pattern: the key third of a cloned qkv bias zeroed in place, and
    a position-bias MLP on a buffer with an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(2, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))
        self.register_buffer("coords", torch.randn(4, 2))

    def forward(self, x):
        bias = self.qkv.bias.clone()
        bias[16:32].zero_()
        qkv = F.linear(x, self.qkv.weight, bias)
        return qkv, torch.sigmoid(self.mlp(self.coords)).sum() * x


def test_parameters_written_in_place_after_a_clone_are_quantized_weights():
    torch.manual_seed(0)
    model = SwinV2Attention().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches((8, 16), n=8)
    prepared, ref = run(model, data)
    assert not calls(prepared, aten.zero_.default) and not calls(prepared, aten.relu_.default)
    assert_prepared_exact(model, prepared, data[0])
    _weight_and_bias_are_integer_constants(ref, linears=1)  # the MLP is a constant
    assert min(output_sqnrs(model, ref, data[0])) >= 30.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class LinearBatchNorm(nn.Module):
    """``[N, L, C_in] -> linear -> [N, L, C_out]``; BatchNorm1d normalises dim 1 (L)."""

    def __init__(self, length: int, features: int) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(16, features), nn.BatchNorm1d(length)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1), self.bn.running_var.uniform_(0.2, 3)
            self.bn.weight.uniform_(0.2, 2), self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_batch_norm_over_another_axis_than_the_linear_output_is_not_folded():
    torch.manual_seed(0)
    model = LinearBatchNorm(length=8, features=8).eval()  # L == C_out: shapes do not tell
    data = batches((4, 8, 16), n=8)
    gm = fold_batch_norm(copy_graph_module(qt.capture(model, data[0])))
    assert calls(gm, aten.batch_norm.default)
    _, ref = run(model, data)
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


def test_batch_norm_after_a_2d_linear_and_a_same_padded_conv_is_folded():
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8)).eval()
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.BatchNorm2d(4)).eval()
    for model, shape in ((linear, (4, 16)), (conv, (2, 3, 8, 8))):
        with torch.no_grad():
            model[1].running_mean.uniform_(-1, 1), model[1].running_var.uniform_(0.2, 3)
        x = torch.randn(*shape)
        gm = fold_batch_norm(copy_graph_module(qt.capture(model, (x,))))
        assert not calls(gm, aten.batch_norm.default), type(model[0]).__name__
        with torch.no_grad():
            assert torch.allclose(gm(x), model(x), atol=1e-5)


class AccumulatesInAView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc[:2].add_(x.sum())
        return x * self.acc


def test_written_to_maps_a_buffer_and_its_views_to_the_in_place_writer():
    gm = qt.capture(AccumulatesInAView(), (torch.randn(4),))
    written = {n.name: w.name for n, w in written_to(gm.graph).items()}
    (add_,) = calls(gm, aten.add_.Tensor)
    assert written["acc"] == add_.name and len(set(written.values())) == 1
    assert set(written) == {"acc", add_.args[0].name}


class ConvBnStack(nn.Module):
    """Two folded pairs with running statistics far from 0 and 1, and a linear + bn head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, bias=seed % 2 == 0), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc, self.b3 = nn.Linear(8 * 6 * 6, 10, bias=False), nn.BatchNorm1d(10)
        with torch.no_grad():
            for bn in (self.b1, self.b2, self.b3):
                bn.running_mean.normal_(0, 3)
                bn.running_var.uniform_(1e-3, 10)
                bn.weight.normal_(0, 2)
                bn.bias.normal_()

    def forward(self, x):
        y = torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
        return self.b3(self.fc(y.flatten(1))), y


@pytest.mark.parametrize("seed", range(6))
def test_folded_batch_norm_is_within_the_stated_tolerance(seed):
    """Folding is not bit-equal: docs/capture.md and FOLD_TOLERANCE say how close it is."""
    from quantree.core.normalizing.fold import FOLD_TOLERANCE

    model = ConvBnStack(seed).eval()
    x = torch.randn(4, 3, 8, 8) * 5
    prepared = qt.prepare(qt.capture(model, (x,)), qt.Int8Quantizer())
    assert not calls(prepared, aten.batch_norm.default)
    with torch.no_grad():
        for want, got in zip(model(x), prepared(x), strict=True):
            assert (want - got).abs().max() <= FOLD_TOLERANCE * want.abs().max()
    documented = (Path(__file__).resolve().parents[2] / "docs" / "capture.md").read_text()
    assert "1e-5 \u00d7 max|output|" in documented


class StandardizedConv(nn.Module):
    """timm's ScaledStdConv2d (NFNet): the weight standardised by a training-mode batch
    norm without running statistics on the parameter alone, on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 3, 3, 3))
        self.gain = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, 8, -1), None, None, self.gain, training=True)
        return F.conv2d(x, w.reshape_as(self.weight))


def test_weight_standardized_by_a_training_mode_batch_norm_is_a_folded_weight():
    torch.manual_seed(0)
    model = StandardizedConv().eval()
    data = batches((1, 3, 16, 16), n=8)
    prepared, ref = run(model, data)
    assert not calls(prepared, aten.batch_norm.default)
    assert_prepared_exact(model, prepared, data[0])
    (conv,) = calls(ref, aten.conv2d.default)
    assert conv.args[1].target is qd.dequantize_per_channel.default
    assert min(output_sqnrs(model, ref, data[0])) >= 30.0


class BatchStatistics(nn.Module):
    def forward(self, x):
        return F.batch_norm(x, None, None, training=True)


def test_batch_statistics_of_an_activation_are_refused_by_name():
    gm = qt.capture(BatchStatistics(), (torch.randn(4, 3, 5),))
    with pytest.raises(qt.QuantreeError, match=r"statistics of each batch.*GroupNorm"):
        qt.prepare(gm, qt.Int8Quantizer())
