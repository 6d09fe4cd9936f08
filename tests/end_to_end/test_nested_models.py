"""End-to-end acceptance of nested inputs/outputs: LSTM/GRU/RNN, tuples, chunk, max, pool."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import quantree as qt

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

THRESHOLD_DB = 25.0


class LstmThreeHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(50, 50, 1)
        self.out, self.h, self.c = nn.Linear(50, 16), nn.Linear(50, 16), nn.Linear(50, 16)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        return self.out(y), self.h(h), self.c(c)


class StackedTuple(nn.Module):
    """The whole (h, c) tuple of one LSTM is the initial state of the next."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.LSTM(16, 24), nn.LSTM(24, 24)

    def forward(self, x):
        y, state = self.first(x)
        return self.second(y, state)[0]


class ReturnsNested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 24)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out, (h, c)


def combine(state):
    h, c = state
    return torch.tanh(h) * c + h


class HelperOnState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 24)

    def forward(self, x):
        out, state = self.lstm(x)
        return out, combine(state)


TUPLE_MODELS = [
    (StackedTuple, (7, 3, 16)),
    (ReturnsNested, (7, 3, 16)),
    (HelperOnState, (7, 3, 16)),
]


def test_lstm_leaves_each_quantized_once_and_linears_read_int8():
    torch.manual_seed(0)
    model = LstmThreeHeads().eval()
    data = batches((10, 4, 50))
    prepared, ref = run(model, data)
    (lstm,) = calls(ref, torch.ops.aten.lstm.input)
    getitems = sorted(
        (u for u in lstm.users if u.target is operator.getitem), key=lambda n: n.args[1]
    )
    assert [g.args[1] for g in getitems] == [0, 1, 2]
    for leaf in getitems:
        (only,) = leaf.users
        assert only.target is qd.quantize_per_tensor.default
    for linear in calls(ref, torch.ops.aten.linear.default):
        x, w, b = linear.args
        assert x.target is qd.dequantize_per_tensor.default
        assert w.target is qd.dequantize_per_channel.default
        stored = getattr(ref, w.args[0].target)
        assert w.args[0].op == "get_attr" and stored.dtype == torch.int8
        assert b.target is qd.dequantize_per_channel.default
        assert getattr(ref, b.args[0].target).dtype == torch.int32
    assert min(output_sqnrs(model, ref, data[0])) >= THRESHOLD_DB
    assert_prepared_exact(model, prepared, data[0])


def test_weights_take_about_a_quarter_of_float_bytes():
    # per-channel scales and zero points cost 8 bytes a channel: small next to 128-wide rows
    model = nn.Sequential(nn.LSTM(128, 128)).eval()
    _, ref = run(model, batches((10, 4, 128), n=2))
    float_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    int_bytes = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    assert int_bytes <= 0.3 * float_bytes


@pytest.mark.parametrize(("cls", "shape"), TUPLE_MODELS, ids=lambda v: getattr(v, "__name__", ""))
def test_whole_tuple_consumers(cls, shape):
    torch.manual_seed(0)
    model = cls().eval()
    data = batches(shape)
    prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    assert min(output_sqnrs(model, ref, data[0])) >= THRESHOLD_DB
    for lstm in calls(prepared, torch.ops.aten.lstm.input):
        state = lstm.args[1]
        assert isinstance(state, list | tuple) and len(state) == 2
    with torch.no_grad():
        assert type(ref(*data[0])) is type(model(*data[0]))


class ChunkSplitMaxPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        y = self.proj(x)
        a, b, c, d = torch.chunk(y, 4, -1)
        e, f = torch.split(y, [12, 20], -1)
        values, indices = torch.max(y, dim=1)
        pooled, where = nn.functional.max_pool2d(y.unsqueeze(1), 2, return_indices=True)
        head = torch.sigmoid(a) * torch.tanh(b) + c - d
        return head, e * 2, f.sum(-1), values, indices, pooled, where


def test_observers_see_only_float_tensors_and_outputs_share_input_params():
    torch.manual_seed(0)
    model = ChunkSplitMaxPool().eval()
    data = batches((2, 6, 16))
    prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    observer_calls = [
        n
        for n in prepared.graph.nodes
        if n.op == "call_module" and n.target.startswith("observer_")
    ]
    assert observer_calls
    for call in observer_calls:
        meta = call.args[0].meta["val"]
        assert isinstance(meta, torch.Tensor) and meta.is_floating_point()
    (linear,) = calls(ref, torch.ops.aten.linear.default)
    (q_in,) = [u for u in linear.users if u.target in QUANTIZE]
    expected = qparams_of(q_in)
    for op in (
        torch.ops.aten.chunk.default,
        torch.ops.aten.split_with_sizes.default,
        torch.ops.aten.max.dim,
        torch.ops.aten.max_pool2d_with_indices.default,
    ):
        (node,) = calls(ref, op)
        for leaf in node.users:
            quantizers = [u for u in leaf.users if u.target in QUANTIZE]
            if leaf.meta["val"].is_floating_point():
                (q,) = quantizers
                assert qparams_of(q) == expected, f"{op} leaf {leaf.args[1]}"
            else:
                assert not quantizers, "integer indices must never be quantized"
    assert min(output_sqnrs(model, ref, data[0])) >= THRESHOLD_DB


@pytest.mark.parametrize(
    "layer",
    [
        nn.GRU(12, 16, num_layers=2, bidirectional=True, batch_first=True),
        nn.RNN(12, 16, num_layers=2, batch_first=True),
        nn.RNN(12, 16, nonlinearity="relu", batch_first=True),
        nn.LSTM(12, 16, num_layers=2, bidirectional=True, batch_first=True, proj_size=8),
    ],
    ids=["gru-2l-bi-bf", "rnn-tanh-2l", "rnn-relu", "lstm-proj-bi"],
)
def test_recurrent_whole_mode(layer):
    torch.manual_seed(0)
    model = layer.eval()
    data = batches((4, 9, 12))
    prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    assert min(output_sqnrs(model, ref, data[0])) >= THRESHOLD_DB
    # one call per layer (stacked calls are split), every output leaf of each leaves it
    # through exactly one quantize
    nodes = [
        n
        for n in ref.graph.nodes
        if n.op == "call_function"
        and n.target
        in (
            torch.ops.aten.gru.input,
            torch.ops.aten.rnn_tanh.input,
            torch.ops.aten.rnn_relu.input,
            torch.ops.aten.lstm.input,
        )
    ]
    assert len(nodes) == layer.num_layers
    for node in nodes:
        for leaf in node.users:
            assert [u.target for u in leaf.users] == [qd.quantize_per_tensor.default]


@pytest.mark.parametrize("share", [False, True])
def test_returned_state_has_its_own_scale_unless_shared(share):
    model = nn.GRU(8, 8).eval()
    data = [(torch.randn(5, 2, 8), torch.randn(1, 2, 8) * 3) for _ in range(5)]
    _, ref = run(model, data, qt.Int8Quantizer(share_recurrent_state=share))
    (gru,) = calls(ref, torch.ops.aten.gru.input)
    h0_dq = gru.args[1]
    (h_n,) = [u for u in gru.users if u.args[1] == 1]
    (q_out,) = h_n.users
    assert (qparams_of(h0_dq) == qparams_of(q_out)) is share
    assert h0_dq.target in DEQUANTIZE


class CellLoops(nn.Module):
    """nn.LSTMCell / GRUCell / RNNCell: export keeps them as aten.*_cell nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru = nn.LSTMCell(8, 16), nn.GRUCell(8, 16)
        self.rnn = nn.RNNCell(8, 16, bias=False)

    def forward(self, x):
        h = c = torch.zeros(x.shape[1], 16)
        outs = []
        for t in range(x.shape[0]):
            h, c = self.lstm(x[t], (h, c))
            outs.append(h)
        return torch.stack(outs), self.gru(x[0]), self.rnn(x[1])


def test_recurrent_cell_ops_are_quantized_at_their_boundary():
    torch.manual_seed(0)
    model = CellLoops().eval()
    data = batches((4, 2, 8))
    prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    for op in (
        torch.ops.aten.lstm_cell.default,
        torch.ops.aten.gru_cell.default,
        torch.ops.aten.rnn_tanh_cell.default,
    ):
        for node in calls(ref, op):
            assert node.args[0].target is qd.dequantize_per_tensor.default
            assert node.args[2].target is qd.dequantize_per_channel.default
    assert min(output_sqnrs(model, ref, data[0])) >= THRESHOLD_DB
