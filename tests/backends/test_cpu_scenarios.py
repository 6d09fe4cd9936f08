"""Every nested-structure scenario of the core issue lowers to CPU kernels at >= 35 dB.

SQNR is measured against the reference (converted) model, per output leaf; integer leaves
(max indices) must be equal.
"""

from __future__ import annotations

import pytest
import torch
from core.test_sharing import ChainedCats, LinearSigmoid, UsesCell
from end_to_end.test_nested_models import (
    CellLoops,
    ChunkSplitMaxPool,
    HelperOnState,
    LstmThreeHeads,
    ReturnsNested,
    StackedTuple,
)
from test_recipes import ConvNet
from torch import nn

import quantree as qt
from quantree.backends import CPU, cpu_backend, load, save

from support import QUANTIZE, batches, calls, leaves, qparams_of, run

THRESHOLD_DB = 35.0


QDQ = ("quantree.quantize.default", "quantree.dequantize.default")


def lowered_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The native kernels in ``gm`` (not counting its native quantize/dequantize)."""
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and str(n.target).startswith("quantree.")
        and str(n.target) not in QDQ
    ]


def check(model: nn.Module, shape: tuple[int, ...]) -> list[str]:
    torch.manual_seed(0)
    model = model.eval()
    data = batches(shape)
    _, ref = run(model, data)
    low = qt.lower(ref, CPU)
    for args in data[:3]:
        with torch.no_grad():
            want, got = leaves(ref(*args)), leaves(low(*args))
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            assert w.shape == g.shape and w.dtype == g.dtype
            if w.is_floating_point():
                assert qt.sqnr(w, g) >= THRESHOLD_DB
            else:
                assert torch.equal(w, g)
    return lowered_ops(low)


SCENARIOS = [
    (LstmThreeHeads, (10, 4, 50), {"quantree.rnn.default", "quantree.linear.default"}),
    (StackedTuple, (7, 3, 16), {"quantree.rnn.default"}),
    (ReturnsNested, (7, 3, 16), {"quantree.rnn.default"}),
    (HelperOnState, (7, 3, 16), {"quantree.rnn.default"}),
    # the linear, chunks, splits, max and pool as one native program (region_strided's views)
    (ChunkSplitMaxPool, (2, 6, 16), {"quantree.program.default"}),
]


@pytest.mark.parametrize(
    ("cls", "shape", "ops"), SCENARIOS, ids=lambda v: getattr(v, "__name__", "")
)
def test_nested_scenarios_lower(cls, shape, ops):
    assert ops <= set(check(cls(), shape))


def test_stacked_lstms_both_lowered():
    assert lowered_ops_count(StackedTuple(), (7, 3, 16)) == 2


def lowered_ops_count(model: nn.Module, shape: tuple[int, ...]) -> int:
    return check(model, shape).count("quantree.rnn.default")


@pytest.mark.parametrize(
    "layer",
    [
        nn.GRU(12, 16, num_layers=2, bidirectional=True, batch_first=True),
        nn.RNN(12, 16, num_layers=2, batch_first=True),
        nn.RNN(12, 16, nonlinearity="relu", batch_first=True),
        nn.LSTM(12, 40, num_layers=2, bidirectional=True, batch_first=True),
        nn.LSTM(33, 70),
    ],
    ids=["gru-2l-bi-bf", "rnn-tanh-2l", "rnn-relu", "lstm-2l-bi-bf", "lstm-odd-sizes"],
)
def test_recurrent_layers_lower(layer):
    shape = (4, 9, layer.input_size) if layer.batch_first else (9, 4, layer.input_size)
    assert check(layer, shape) == ["quantree.rnn.default"] * layer.num_layers  # split per layer


STACKED = {  # layers whose inner states were never observed: bounds, or no lowering
    "lstm-nobias-bi": lambda seed: nn.LSTM(8, 16, 2, bidirectional=True, bias=False),
    "lstm-proj-bi": lambda seed: nn.LSTM(8, 16, 2, bidirectional=True, bias=False, proj_size=6),
    "lstm-3l": lambda seed: nn.LSTM(8, 16, 3),
    "gru-2l": lambda seed: nn.GRU(8, 16, 2, bias=False),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("factory", STACKED.values(), ids=STACKED.keys())
def test_stacked_layers_keep_the_reference_accuracy(factory, seed):
    """Stacked layers kept whole (``split_layers=False``; the default splits them): outputs
    between layers quantized as int16 on their own range per call, states of the layers
    before the last on a grid that covers them whatever the input (these bias-free random
    layers had 16-28 dB when the grid was guessed from the last layer)."""
    torch.manual_seed(seed)
    model, data = factory(seed).eval(), batches((5, 2, 8), n=4)
    # min-max ranges, as written for (the default's range search gave lstm-proj-bi seed 0
    # 34.95 dB here, lowered against its own reference)
    minmax = qt.ObserverKind.MINMAX
    _, ref = run(model, data, qt.Int8Quantizer(split_layers=False, activation_observer=minmax))
    low = qt.lower(ref, CPU)
    assert [str(n.target) for n in low.graph.nodes].count("quantree.rnn.default") == 1
    with torch.no_grad():
        for args in data[:3]:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert qt.sqnr(want, got) >= THRESHOLD_DB


def test_stacked_relu_rnn_lowers_layer_by_layer():
    """A stacked ReLU RNN's inner states have no bound the backend could assume (seed 3
    clipped to 12 dB when it tried); the recipe splits it per layer, so each layer's output
    is observed and each layer is one native call, within the threshold."""
    torch.manual_seed(3)
    targets = check_data(nn.RNN(8, 12, 2, nonlinearity="relu"), batches((6, 2, 8), n=6))
    assert "aten.rnn_relu.input" not in targets and targets.count("quantree.rnn.default") == 2


class ExplicitState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, 2)

    def forward(self, x, h, c):
        return self.lstm(x, (h, c))


def test_lstm_with_given_initial_state():
    """Initial states produced by another LSTM, as when a model carries state across calls."""
    torch.manual_seed(0)
    model, producer = ExplicitState().eval(), nn.LSTM(16, 32, 2).eval()
    with torch.no_grad():
        data = [(x, *producer(p)[1]) for x, p in batches((6, 3, 16), (6, 3, 16))]
    _, ref = run(model, data)
    low = qt.lower(ref, CPU)
    assert lowered_ops(low) == ["quantree.rnn.default"] * 2  # one per layer
    with torch.no_grad():
        for w, g in zip(leaves(ref(*data[0])), leaves(low(*data[0])), strict=True):
            assert qt.sqnr(w, g) >= THRESHOLD_DB


def test_int16_hidden_feedback_is_closer_to_reference():
    torch.manual_seed(0)
    model = nn.LSTM(48, 64).eval()
    data = batches((40, 2, 48), n=4)
    _, ref = run(model, data)
    with torch.no_grad():
        want = ref(*data[1])[0]
        h8 = qt.sqnr(want, qt.lower(ref, cpu_backend(8))(*data[1])[0])
        h16 = qt.sqnr(want, qt.lower(ref, cpu_backend(16))(*data[1])[0])
    assert h8 >= THRESHOLD_DB and h16 >= 50.0 and h16 > h8 + 6.0


class LearnedState(nn.Module):
    """The initial state is a buffer: convert folds it into an int8 constant."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.register_buffer("h0", 0.5 * torch.tanh(torch.randn(1, 3, 32)))

    def forward(self, x):
        return self.gru(x, self.h0)[0]


def test_folded_initial_state():
    assert check(LearnedState(), (3, 8, 16)) == ["quantree.rnn.default"]


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 24, 3, stride=2)
        self.fc = nn.Linear(24 * 7 * 7, 10)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(y.flatten(1))


def test_conv_relu_and_linear_lower():
    torch.manual_seed(0)
    ops = check(SmallCnn(), (2, 3, 16, 16))
    assert ops.count("quantree.conv2d.default") == 2 and "quantree.linear.default" in ops


class ConvView(nn.Module):
    """A channels-last int8 conv output read by ``view`` in int8 and by float code."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.shape[0], -1)), y.sum((2, 3)), y.view(2, 8, 36).float()


def test_channels_last_conv_outputs_feed_views_and_float_code():
    ops = check(ConvView(), (2, 3, 8, 8))
    assert "quantree.conv2d.default" in ops and "quantree.linear.default" in ops


def test_no_reference_quantize_dequantize_left_around_kernels():
    """int8 flattening between conv and linear; native q/dq at the model's edges."""
    torch.manual_seed(0)
    model = SmallCnn().eval()
    _, ref = run(model, batches((2, 3, 16, 16), n=3))
    low = qt.lower(ref, CPU)
    targets = [str(n.target) for n in low.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if t.startswith("quantized_decomposed")]
    assert targets.count("quantree.quantize.default") == 1
    assert targets.count("quantree.dequantize.default") == 1
    assert "aten.flatten.using_ints" in targets


def test_reference_is_untouched_and_weights_not_duplicated():
    torch.manual_seed(0)
    model = nn.LSTM(64, 64).eval()
    _, ref = run(model, batches((5, 2, 64), n=3))
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    low = qt.lower(ref, CPU)
    assert all(torch.equal(before[k], v) for k, v in ref.state_dict().items())
    ref_bytes = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    low_bytes = sum(t.numel() * t.element_size() for t in low.state_dict().values())
    assert low_bytes < 1.2 * ref_bytes


CELLS_LAYERS = [
    nn.LSTM(24, 32, 2),
    nn.GRU(24, 32, bidirectional=True, batch_first=True),
    nn.RNN(24, 32),
]


CELLS_RECIPES = {
    "int8": {},
    "int16-cell": {"cell_state_dtype": qt.QDtype.INT16},
    "integer-lstm": {"cell_state_dtype": qt.QDtype.INT16, "gate_dtype": qt.QDtype.INT16},
}


@pytest.mark.parametrize("recipe", CELLS_RECIPES.values(), ids=CELLS_RECIPES.keys())
@pytest.mark.parametrize("layer", CELLS_LAYERS, ids=["lstm-2l", "gru-bi-bf", "rnn"])
def test_cells_mode_lowers(layer, recipe, tmp_path):
    """Cell bodies are lowered and every loop runs as one native program, int16 points
    (reference quantize/dequantize around float gate math) included."""
    torch.manual_seed(0)
    model = layer.eval()
    shape = (3, 9, 24) if layer.batch_first else (9, 3, 24)
    data = batches(shape, n=4)
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS, **recipe)
    _, ref = run(model, data, quantizer)
    ref_loops = [type(m).__name__ for m in ref.modules() if type(m).__name__ == "CellLoop"]
    low = qt.lower(ref, CPU)
    loops = [type(m).__name__ for m in low.modules() if "CellLoop" in type(m).__name__]
    assert len(loops) == len(ref_loops) > 0
    assert [type(m).__name__ for m in ref.modules() if "CellLoop" in type(m).__name__] == ref_loops
    with torch.no_grad():
        for args in data[:2]:
            for w, g in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert qt.sqnr(w, g) >= THRESHOLD_DB
    assert set(loops) == {"NativeCellLoop"}
    if isinstance(layer, nn.LSTM):
        save(low, tmp_path / "cells.pt2", data[0])
        with torch.no_grad():
            assert torch.equal(load(tmp_path / "cells.pt2")(*data[0])[0], low(*data[0])[0])


def test_conv_model_save_load_round_trip(tmp_path):
    """Channels-last int8 conv outputs survive torch.export (fake strides match real ones)."""
    torch.manual_seed(0)
    model = SmallCnn().eval()
    data = batches((2, 3, 16, 16), n=3)
    _, ref = run(model, data)
    low = qt.lower(ref, CPU)
    save(low, tmp_path / "cnn.pt2", data[0])
    loaded = load(tmp_path / "cnn.pt2")
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), low(*data[1]))


class GivenState(nn.Module):
    """A GRU whose initial state is an input (projected from an encoder, say): |h0| > 1."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 32, batch_first=True)

    def forward(self, x, h):
        return self.gru(x, h)


@pytest.mark.parametrize("hidden_bits", [8, 16])
def test_gru_with_wide_given_initial_state(hidden_bits):
    """A GRU's state is a convex mix of the candidate and h_prev, so an initial state with
    |h0| > 1 keeps the hidden state outside [-1, 1]: the inner grid must not be clipped to
    [-1, 1] (clipped, the output was 19-21 dB from the reference with either feedback).

    h_n is quantized on h0's wide grid (LSB ~0.05), where the int8 feedback's small
    differences flip a few roundings: there it must stay within one LSB of the reference.
    """
    torch.manual_seed(0)
    model = GivenState().eval()
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(3, 9, 16, generator=g), 2 * torch.randn(1, 3, 32, generator=g))
        for _ in range(8)
    ]
    _, ref = run(model, data)
    low = qt.lower(ref, cpu_backend(hidden_bits))
    assert lowered_ops(low) == ["quantree.rnn.default"]
    (quantize_h,) = [q for q in calls(ref, QUANTIZE[0]) if q.args[0].name == "h"]
    h_scale = qparams_of(quantize_h)[0]  # h0 and h_n share one scale
    with torch.no_grad():
        for args in data[:3]:
            (want_y, want_h), (got_y, got_h) = ref(*args), low(*args)
            assert qt.sqnr(want_y, got_y) >= THRESHOLD_DB
            assert (want_h - got_h).abs().max() <= h_scale * 1.001
            if hidden_bits == 16:
                assert qt.sqnr(want_h, got_h) >= THRESHOLD_DB


def check_data(
    model: nn.Module, data: list[tuple[torch.Tensor, ...]], quantizer: qt.Quantizer | None = None
) -> list[str]:
    """``check`` for models of several inputs or with their own quantizer."""
    torch.manual_seed(0)
    _, ref = run(model.eval(), data, quantizer)
    low = qt.lower(ref, CPU)
    with torch.no_grad():
        for args in data[:3]:
            want, got = leaves(ref(*args)), leaves(low(*args))
            assert len(want) == len(got) > 0
            for w, g in zip(want, got, strict=True):
                assert w.shape == g.shape and w.dtype == g.dtype
                assert qt.sqnr(w, g) >= THRESHOLD_DB
    return [str(n.target) for n in low.graph.nodes if n.op == "call_function"]


def custom_op_quantizer() -> qt.Quantizer:
    specs = (
        qt.QuantSpec(qt.QDtype.INT8),
        (qt.QuantSpec(qt.QDtype.UINT8), qt.QuantSpec(qt.QDtype.INT16, symmetric=True)),
    )
    rule = qt.Rule((torch.ops.quantree_test.cell,), lambda n: qt.Annotation(outputs=specs))
    return qt.Quantizer([rule])


def conv_net_with_batch_norm() -> nn.Module:
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        bn = model.features[1]
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 2)
    return model


# name: (model factory, input shapes, quantizer factory, ops the lowered graph must hold)
CORE_SCENARIOS = {
    "custom-op": (UsesCell, [(4, 8)] * 3, custom_op_quantizer, {"quantree_test.cell.default"}),
    "chained-cats": (ChainedCats, [(2, 3)] * 3, None, {"quantree.program.default"}),
    "fixed-sigmoid": (
        LinearSigmoid,
        [(4, 6)],
        None,
        {"quantree.linear.default", "quantree.lookup.default"},
    ),
    "cell-ops": (
        CellLoops,
        [(4, 2, 8)],
        None,
        {"quantree.rnn_cell.default"},  # every kind of cell step native
    ),
    "lstm-proj": (
        lambda: nn.LSTM(12, 16, num_layers=2, bidirectional=True, batch_first=True, proj_size=8),
        [(4, 9, 12)],
        None,
        {"quantree.rnn.default"},
    ),
    "convnet-bn": (
        conv_net_with_batch_norm,
        [(2, 3, 12, 12), (2, 4, 10)],
        None,
        {"quantree.conv2d.default", "quantree.linear.default"},
    ),
}


@pytest.mark.parametrize(
    ("factory", "shapes", "quantizer", "ops"), CORE_SCENARIOS.values(), ids=CORE_SCENARIOS.keys()
)
def test_core_scenarios_lower(factory, shapes, quantizer, ops):
    """The core issue's other scenarios: each lowers (native kernels where the CPU backend
    has them, the rest left as the reference computes it) and stays >= 35 dB."""
    targets = check_data(factory(), batches(*shapes, n=6), quantizer and quantizer())
    assert ops <= set(targets)
    assert not [t for t in targets if "batch_norm" in t]


class StatefulLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16)

    def forward(self, x, state):
        return self.lstm(x, state)


def test_pinned_state_grids_survive_lowering():
    """h_n / c_n given parameters of their own (not their initial state's): the native layer
    returns them on those grids (it once reused the initial state's, at 4.5 / -6.5 dB)."""
    aten = torch.ops.aten

    def pinned_states(node):
        base = qt.Int8Quantizer().annotate_node(node)
        h_n, c_n = qt.FixedSpec(2 / 256, 0), qt.FixedSpec(8 / 256, 0)
        return qt.Annotation(outputs=(base.outputs[0], h_n, c_n), inputs=base.inputs)

    def sample():
        return (torch.randn(10, 3, 8), (torch.randn(1, 3, 16) * 0.5, torch.randn(1, 3, 16) * 0.5))

    torch.manual_seed(0)
    quantizer = qt.Int8Quantizer() + qt.Quantizer([qt.Rule((aten.lstm.input,), pinned_states)])
    data = [sample() for _ in range(6)]
    ref = qt.quantize(
        StatefulLstm().eval(),
        data[0],
        data,
        quantizer=quantizer,
        progress=False,
        backend="reference",
    )
    low = qt.lower(ref, CPU)
    assert "quantree.rnn.default" in {str(n.target) for n in low.graph.nodes}
    with torch.no_grad():
        (_, (h_ref, c_ref)), (_, (h, c)) = ref(*data[0]), low(*data[0])
    assert torch.equal(h * 128, (h * 128).round()) and torch.equal(c * 32, (c * 32).round())
    assert qt.sqnr(h_ref, h) >= 30.0 and qt.sqnr(c_ref, c) >= 25.0
