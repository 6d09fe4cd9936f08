"""A whole-mode recurrent op on a packed sequence runs in one native call.

``quantree.rnn_packed_sequence`` runs step t of every layer and direction on the
``batch_sizes[t]`` sequences still running (the first rows): a finished sequence keeps its
final state, and in reverse a sequence starts at its own last step from its initial state
on the initial state's grid. Each row's arithmetic is the row's alone, so a packed batch
must give exactly what each sequence gives run alone through the padded kernel, whatever
the lengths, for every cell kind, one or two layers, both directions, a projection, int8 or
int16 feedback. Between stacked layers the output is handed on as int16 on the range it
took over the call's rows: there both sides run on the same pinned steps, and a packed
batch of equal lengths must equal the padded batch with its own ranges. Bad
``batch_sizes`` are refused before the native call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.direct import DirectCall
from quantree.backends.cpu.native.packing import pack, row_sums
from quantree.backends.cpu.ops.elementwise import dequantize, quantize
from quantree.backends.cpu.ops.recurrent.rnn import RnnRunner
from quantree.backends.cpu.ops.recurrent.rnn_packed import PackedRnnRunner

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


class Op:
    """Random int8 weights and grids of one op (what lowering would derive from a model)."""

    def __init__(self, kind, features, hidden, layers, bidirectional, proj, bits, seed):
        g = torch.Generator().manual_seed(seed)
        self.kind, self.hidden, self.layers, self.bidir = kind, hidden, layers, bidirectional
        self.proj, self.bits, self.features = proj, bits, features
        dirs = 2 if bidirectional else 1
        self.width = proj or hidden
        n = GATES[kind] * hidden

        def int8(*shape):
            return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)

        def uniform(size, lo, hi):
            return lo + (hi - lo) * torch.rand(size, generator=g)

        self.params: list[torch.Tensor] = []
        for layer in range(layers):
            for _ in range(dirs):
                k = features if layer == 0 else dirs * self.width
                for w in (int8(n, k), int8(n, self.width)):
                    self.params += [pack(w), row_sums(w), uniform(n, 1e-3, 4e-3) / (k**0.5)]
                    self.params.append(uniform(n, -0.5, 0.5))
                if proj:
                    w_hr = int8(proj, hidden)
                    self.params += [pack(w_hr), row_sums(w_hr), uniform(proj, 5e-4, 2e-3)]
        # x, inner, y, h, c, inner_fb, last, last_fb, h_n, c_n (as lowering_recurrent lays out)
        self.qparams = [0.05, 3.0, 2.0 / 255, -1.0, 1.0 / 100, -3.0, 1.0 / 127, 2.0, 1.0 / 60]
        self.qparams += [5.0, 1.0 / 32767, 1.0 / 120, 4.0, 1.0 / 32000, 1.0 / 127, -2.0]
        self.qparams += [1.0 / 60, 1.0]

    def args(self):
        return (self.params, self.hidden, self.layers, self.bidir)

    def rest(self):
        return (self.qparams, self.bits, self.proj)

    def states(self, batch: int, g: torch.Generator) -> list[torch.Tensor]:
        blocks = self.layers * (2 if self.bidir else 1)
        shapes = [(blocks, batch, self.width)]
        if self.kind == "lstm":
            shapes.append((blocks, batch, self.hidden))
        return [torch.randint(-128, 128, s, generator=g, dtype=torch.int8) for s in shapes]


def packed_rows(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of sequences sorted longest first, in packed order, and their batch sizes."""
    lengths = [len(x) for x in xs]
    sizes = torch.tensor([sum(n > t for n in lengths) for t in range(lengths[0])])
    rows = torch.cat([torch.stack([x[t] for x in xs if len(x) > t]) for t in range(lengths[0])])
    return rows, sizes


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(GATES)),
    layers=st.sampled_from([1, 2]),
    bidirectional=st.booleans(),
    projected=st.booleans(),
    bits=st.sampled_from([8, 16]),
    features=st.integers(1, 19),
    hidden=st.integers(1, 21),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_packed_rows_equal_each_sequence_run_alone(
    kind, layers, bidirectional, projected, bits, features, hidden, lengths, seed
) -> None:
    proj = hidden // 2 if projected and kind == "lstm" else 0  # torch: below hidden
    spec = Op(kind, features, hidden, layers, bidirectional, proj, bits, seed)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = sorted(lengths, reverse=True)
    xs = [torch.randint(-128, 128, (n, features), generator=g, dtype=torch.int8) for n in lengths]
    rows, sizes = packed_rows(xs)
    hx = spec.states(len(lengths), g)
    # the steps between layers pinned on both sides (else each side's own range)
    pin = [1.5 / 32767 * (i + 1) for i in range(layers - 1)]
    y, h_n, c_n = RnnRunner().packed(
        kind, rows, sizes, hx, *spec.args(), *spec.rest(), inner_steps=pin
    )
    first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), sizes]), 0)
    for i, x in enumerate(xs):
        alone = [s[:, i : i + 1].contiguous() for s in hx]
        y1, h1, c1 = RnnRunner()(
            kind, x[:, None], alone, *spec.args(), False, *spec.rest(), inner_steps=pin
        )
        assert torch.equal(torch.stack([y[first[t] + i] for t in range(len(x))]), y1[:, 0])
        assert torch.equal(h_n[:, i], h1[:, 0])
        if kind == "lstm":
            assert torch.equal(c_n[:, i], c1[:, 0])


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(sorted(GATES)),
    bidirectional=st.booleans(),
    bits=st.sampled_from([8, 16]),
    steps=st.integers(1, 7),
    batch=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_equal_lengths_equal_the_padded_batch_with_its_own_ranges(
    kind, bidirectional, bits, steps, batch, seed
) -> None:
    spec = Op(kind, 5, 7, 2, bidirectional, 3 if kind == "lstm" else 0, bits, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(-128, 128, (steps, batch, 5), generator=g, dtype=torch.int8)
    hx = spec.states(batch, g)
    sizes = torch.full((steps,), batch)
    packed = RnnRunner().packed(kind, x.reshape(-1, 5), sizes, hx, *spec.args(), *spec.rest())
    padded = RnnRunner()(kind, x, hx, *spec.args(), False, *spec.rest())
    assert torch.equal(packed[0], padded[0].reshape(steps * batch, -1))
    assert torch.equal(packed[1], padded[1]) and torch.equal(packed[2], padded[2])


@pytest.mark.parametrize(
    "sizes",
    [[2, 3], [3, 0], [-1], [], [[3, 2]], [3.0, 2.0], [2, 2, 9]],
    ids=["increasing", "zero", "negative", "empty", "2-d", "float", "too many rows"],
)
def test_bad_batch_sizes_are_refused_before_the_native_call(sizes) -> None:
    spec = Op("gru", 4, 5, 2, True, 0, 8, 0)
    with pytest.raises(NativeArgumentError, match="batch_sizes"):
        torch.ops.quantree.rnn_packed_sequence(
            "gru", torch.zeros(5, 4, dtype=torch.int8), torch.tensor(sizes),
            spec.states(3, torch.Generator()), *spec.args(), *spec.rest(),
        )  # fmt: skip


def test_rows_of_another_shape_are_refused() -> None:
    spec = Op("gru", 4, 5, 1, False, 0, 8, 0)
    with pytest.raises(NativeArgumentError, match="packed rows"):
        torch.ops.quantree.rnn_packed_sequence(
            "gru", torch.zeros(3, 1, 4, dtype=torch.int8), torch.tensor([2, 1]),
            spec.states(2, torch.Generator()), *spec.args(), *spec.rest(),
        )  # fmt: skip


def test_states_of_another_batch_are_refused() -> None:
    spec = Op("lstm", 4, 5, 1, False, 0, 8, 0)
    with pytest.raises(NativeArgumentError, match="h_0"):
        torch.ops.quantree.rnn_packed_sequence(
            "lstm", torch.zeros(3, 4, dtype=torch.int8), torch.tensor([2, 1]),
            spec.states(1, torch.Generator()), *spec.args(), *spec.rest(),
        )  # fmt: skip


def test_pinned_steps_must_match_the_layers() -> None:
    spec = Op("gru", 4, 5, 2, False, 0, 8, 0)
    with pytest.raises(NativeArgumentError, match="inner_steps"):
        RnnRunner().packed(
            "gru", torch.zeros(3, 4, dtype=torch.int8), torch.tensor([2, 1]),
            spec.states(2, torch.Generator()), *spec.args(), *spec.rest(), inner_steps=[],
        )  # fmt: skip


class Packed(nn.Module):
    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, lengths: torch.Tensor):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, state = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0], state


def test_lowered_model_makes_one_call_and_follows_its_unsorted_batch(tmp_path) -> None:
    """A model packing unsorted lengths (``enforce_sorted=False``): one native call per
    op, a permuted batch gives the permuted outputs, bit for bit (the ranges between
    layers are over the same rows), and the saved model loads to the same bits."""
    torch.manual_seed(0)
    model = Packed(nn.LSTM(6, 10, 2, batch_first=True, bidirectional=True)).eval()
    g = torch.Generator().manual_seed(1)

    def batch():
        return torch.randn(5, 9, 6, generator=g), torch.tensor([4, 9, 2, 7, 4])

    data = [batch() for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        # the stacked op kept whole (the default splits it per layer): its one call serves both
        quantizer = qt.Int8Quantizer(split_layers=False)
        lowered = qt.quantize(
            model, data[0], data, quantizer=quantizer, backend=CPU, progress=False
        )
    (node,) = [n for n in lowered.graph.nodes if "rnn_packed_sequence" in str(n.target)]
    assert isinstance(node.target, DirectCall)
    runner = node.target.implementation
    assert isinstance(runner, PackedRnnRunner)
    calls = []
    run = runner.runner.packed
    runner.runner.packed = lambda *a, **k: calls.append(1) or run(*a, **k)  # type: ignore[method-assign]
    x, lengths = batch()
    out, (h_n, c_n) = lowered(x, lengths)
    assert len(calls) == 1
    order = torch.tensor([3, 0, 4, 1, 2])
    out_p, (h_p, c_p) = lowered(x[order], lengths[order])
    assert torch.equal(out_p, out[order])
    assert torch.equal(h_p, h_n[:, order]) and torch.equal(c_p, c_n[:, order])
    save(lowered, tmp_path / "packed.pt2", data[0])
    again = load(tmp_path / "packed.pt2")(x, lengths)
    assert torch.equal(again[0], out) and torch.equal(again[1][0], h_n)


def test_quantize_and_dequantize_around_the_op_run_inside_it_exactly() -> None:
    spec = Op("lstm", 6, 9, 2, True, 4, 16, 3)
    g = torch.Generator().manual_seed(4)
    rows, sizes = torch.randn(13, 6, generator=g) * 3, torch.tensor([4, 3, 3, 2, 1])
    hx = spec.states(4, g)
    x_s, x_z, y_s, y_z = spec.qparams[0], int(spec.qparams[1]), spec.qparams[4], spec.qparams[5]
    fused = RnnRunner().packed(
        "lstm", rows, sizes, hx, *spec.args(), *spec.rest(), float_input=True, float_output=True
    )
    apart = RnnRunner().packed(
        "lstm", quantize(rows, x_s, x_z), sizes, hx, *spec.args(), *spec.rest()
    )
    assert fused[0].dtype == torch.float32
    assert torch.equal(fused[0], dequantize(apart[0], y_s, y_z))
    assert torch.equal(fused[1], apart[1]) and torch.equal(fused[2], apart[2])
