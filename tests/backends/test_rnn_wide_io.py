"""Whole-mode recurrent layers with int16 input and output sequences, and the AMX GEMM.

``Int8Quantizer(recurrent_sequence_dtype=QDtype.INT16)`` quantizes a whole-mode layer's
input and output sequences as symmetric int16: the lowered ``quantree.rnn`` reads the float input
as int16 byte planes and writes its float output on the int16 grid. The AMX path of the
many-row GEMMs (input projection, steps of 16 rows and more) gives the VNNI path's bits.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.loader import library

from support import batches

RNN = torch.ops.quantree.rnn.default


def sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * math.log10(float(want.pow(2).sum() / (want - got).pow(2).sum()))


class Seq(nn.Module):
    def __init__(self, layer: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.layer, self.head = layer, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)[0]
        return y if self.head is None else self.head(y)


def lowered(model: nn.Module, data: list, dtype: qt.QDtype) -> tuple:
    quantizer = qt.Int8Quantizer(recurrent_sequence_dtype=dtype)
    ref = qt.quantize(model, data[0], data, quantizer=quantizer, progress=False,
                      backend="reference")  # fmt: skip
    return ref, qt.lower(ref, CPU)


def rnn_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if str(n.target) == "quantree.rnn.default"]


def test_int16_sequences_lowered_and_more_accurate_than_int8():
    torch.manual_seed(0)
    model = Seq(nn.LSTM(16, 32, 2)).eval()
    data = batches((24, 1, 16), n=4)
    test = batches((24, 1, 16), n=2, seed=5)
    results = {}
    for dtype in (qt.QDtype.INT8, qt.QDtype.INT16):
        _, low = lowered(model, data, dtype)
        nodes = rnn_nodes(low)
        assert len(nodes) == 2  # split per layer
        bits = 16 if dtype is qt.QDtype.INT16 else 8
        # int16: float in and out of both layers (x_bits, y_bits); int8: the old op
        assert all(tuple(n.args[-2:]) == (bits, bits) for n in nodes)
        with torch.no_grad():
            want = torch.cat([model(x).flatten() for (x,) in test])
            got = torch.cat([low(x).flatten() for (x,) in test])
        results[bits] = sqnr(want, got)
    # measured 41.6 dB (int8) and 52.2 dB (int16) on this seed
    assert results[16] > results[8] + 6.0, results


def test_int16_output_read_by_a_linear():
    """The float output stays on its int16 grid: the graph's quantize reads it exactly."""
    torch.manual_seed(1)
    model = Seq(nn.LSTM(8, 24), nn.Linear(24, 5)).eval()
    data = batches((10, 2, 8), n=4)
    ref, low = lowered(model, data, qt.QDtype.INT16)
    (node,) = rnn_nodes(low)
    assert tuple(node.args[-2:]) == (16, 16)
    (leaf,) = node.users
    # the quantize the linear's pattern reads stays, fed the kernel's float
    assert [str(u.target) for u in leaf.users] == [
        "quantized_decomposed.quantize_per_tensor.default"
    ]
    with torch.no_grad():
        x = data[1][0]
        assert sqnr(ref(x), low(x)) > 30.0  # the kernel's int8 feedback, not the boundary


def test_amx_gives_the_vnni_bits():
    lib = library()
    if lib.qt_amx(-1) != 1:
        pytest.skip("no AMX on this CPU (or the AVX-512 VNNI path is not selected)")
    torch.manual_seed(2)
    # a batch over 16: the input projection and every step of 16 rows and more on the tiles
    # (qt_amx(2): whatever their size), K and H not multiples of 64 (the tiles' k tails)
    model = Seq(nn.LSTM(40, 72, 2)).eval()
    data = batches((20, 17, 40), n=3)
    _, low = lowered(model, data, qt.QDtype.INT16)
    _, low8 = lowered(model, data, qt.QDtype.INT8)
    try:
        with torch.no_grad():
            x = data[1][0]
            assert lib.qt_amx(2) == 2
            on = (low(x), low8(x))
            assert lib.qt_amx(0) == 0
            off = (low(x), low8(x))
    finally:
        lib.qt_amx(1)
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)


def test_int16_boundary_needs_float_and_a_symmetric_grid():
    x = torch.zeros(2, 1, 4, dtype=torch.int8)
    q = [0.1, 0.0, 0.01, 0, 0.01, 0, 0.01, 0, 0.01, 0, 1e-4, 0.01, 0, 1e-4, 0.01, 0, 0.01, 0]
    with pytest.raises(NativeArgumentError, match="x_bits 16 needs float_input"):
        RNN("lstm", x, [], [], 4, 1, False, False, q, 8, 0, False, False, 16, 8)
    with pytest.raises(NativeArgumentError, match="y_bits 16 reads a symmetric grid"):
        bad = list(q)
        bad[5] = 3
        RNN("lstm", x.float(), [], [], 4, 1, False, False, bad, 8, 0, True, True, 8, 16)


def test_int16_sequences_give_the_same_bits_on_every_vector_path():
    """The AVX-512 planes and rounding (and AMX) against AVX2's portable ones."""
    from quantree.backends.cpu.native.loader import ISA_NAMES, isa_cap

    lib = library()
    paths = [
        i for i, name in enumerate(ISA_NAMES) if name != "portable" and lib.qt_select_isa(i) == i
    ]
    lib.qt_select_isa(isa_cap())
    if len(paths) < 2:
        pytest.skip("fewer than two vector paths on this CPU")
    torch.manual_seed(3)
    model = Seq(nn.LSTM(64, 24, 2)).eval()
    data = batches((20, 17, 64), n=3)
    _, low = lowered(model, data, qt.QDtype.INT16)
    results = []
    try:
        for isa in paths:
            assert lib.qt_select_isa(isa) == isa
            with torch.no_grad():
                results.append(low(data[1][0]))
    finally:
        lib.qt_select_isa(isa_cap())
    for got in results[1:]:
        assert torch.equal(results[0], got)


def test_an_int8_output_read_only_by_its_dequantize_is_written_float(monkeypatch):
    """The layer's int8 output read only through a dequantize on its grid (here a linear
    whose input is int16 under WEIGHTED_INPUTS, as in DPRNN: it reads float) becomes the
    kernel's float output: one op fewer, the same bits
    (``rules/recurrent/layers.float_outputs_read_by_dequantize``)."""
    import quantree.backends.cpu.backend as cpu_backend

    torch.manual_seed(0)
    model = Seq(nn.LSTM(8, 16, batch_first=True, bidirectional=True), nn.Linear(32, 8)).eval()
    data, test = batches((3, 12, 8), n=4), batches((3, 12, 8), n=2, seed=5)
    quantizer = qt.Int8Quantizer(activations=qt.ActivationPoints.WEIGHTED_INPUTS)
    ref = qt.quantize(model, data[0], data, quantizer=quantizer, progress=False,
                      backend="reference")  # fmt: skip
    low = qt.lower(ref, CPU)
    (node,) = rnn_nodes(low)
    assert node.args[12] is True  # float_output
    dequantize = torch.ops.quantree.dequantize.default
    assert not any(n.target == dequantize for n in low.graph.nodes)
    monkeypatch.setattr(cpu_backend, "float_outputs_read_by_dequantize", lambda gm: None)
    before = qt.lower(ref, CPU)
    (int8_out,) = rnn_nodes(before)
    assert int8_out.args[12] is False
    assert sum(n.target == dequantize for n in before.graph.nodes) == 1
    with torch.no_grad():
        for (x,) in test:
            assert torch.equal(low(x), before(x))


@pytest.mark.parametrize("dtype", [qt.QDtype.INT8, qt.QDtype.INT16], ids=["int8", "int16"])
def test_batch_first_rows_read_through_strides_equal_the_time_major_op(dtype, monkeypatch):
    """A batch-first float input is read through its strides and the batch-first float
    output written dense (``qt_rnn_batch_first``): the bits of the time-major op on a
    transposed contiguous copy, for a permuted view (DPRNN's chunks), a sliced one and a
    contiguous one."""
    torch.manual_seed(2)
    model = Seq(nn.LSTM(8, 12, batch_first=True, bidirectional=True)).eval()
    data = batches((3, 7, 8), n=4)
    _, low = lowered(model, data, dtype)
    (node,) = rnn_nodes(low)
    args = list(node.args)
    assert args[7] is True and args[11:13] == [True, True]  # batch_first, float in and out
    consts = [getattr(low, str(p.target)) for p in args[3]]
    kind, _, hx, _, hidden, layers, bidir, _, qparams, *rest = args
    maps = torch.randn(1, 8, 5, 9)  # [batch, features, chunk, n_chunks]
    views = {
        "permuted": maps.permute(0, 3, 2, 1).reshape(9, 5, 8),  # a view (batch 1)
        "sliced": torch.randn(5, 11, 8)[:, 2:9],
        "contiguous": torch.randn(6, 4, 8),
    }
    assert views["permuted"].stride(2) != 1  # the features are the slowest dimension
    from quantree.backends.cpu.ops.recurrent import rnn as rnn_op

    taken = []
    strided = rnn_op.RnnRunner.batch_first
    monkeypatch.setattr(
        rnn_op.RnnRunner, "batch_first", lambda self, *a: taken.append(1) or strided(self, *a)
    )
    for name, x in views.items():
        assert name == "contiguous" or not x.is_contiguous()
        got = RNN(kind, x, hx, consts, hidden, layers, bidir, True, qparams, *rest)
        time_major = x.transpose(0, 1).contiguous()
        want = RNN(kind, time_major, hx, consts, hidden, layers, bidir, False, qparams, *rest)
        assert got[0].shape == (x.shape[0], x.shape[1], 24)
        assert torch.equal(got[0], want[0].transpose(0, 1)), name
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), name
    assert len(taken) == len(views)  # every batch-first call took the strided entry
