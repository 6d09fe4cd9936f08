"""Packed sequences in ONNX: ``pack_padded_sequence -> LSTM/GRU/RNN -> pad_packed_sequence``
exported as the padded ONNX layers with ``sequence_lens``, run in ONNX Runtime.

Tolerances: the QDQ export within one output LSB of the reference graph, as
``test_onnx_export``'s (the same integer grids, float ops in another order), and its SQNR
against float within that file's 1 dB band. The ONNX Runtime target's LSTM
(``DynamicQuantizeLSTM``) quantizes its input and state per call on its own uint8 grid: on
these small random-weight layers that costs it 0.1-1.1 dB against the reference on batches
with every sequence at full length (no packing involved) and up to 1.6 dB on these 15
sequences, above ``test_onnx_onnxruntime``'s 0.5 dB, hence its band of 2 dB here (each
sequence's final state there is within 2% of the float layer run on that sequence alone, as
the QDQ export's is); its GRU/RNN ``Scan`` gets the same band.
Positions past a sequence's length must hold exactly the reference's padding; the final
states are compared like the output.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_leaves

pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install 'quantree[onnx]')")
pytest.importorskip("onnxruntime", reason="ONNX tests need onnxruntime")
pytest.importorskip("onnxscript", reason="ONNX export tests need onnxscript")

import onnx

import quantree as qt
from quantree.backends.onnx import run_onnx
from quantree.core.qdq import DEQUANTIZE_PER_TENSOR

from support import SortedPacked, for_onnxruntime, onnxruntime_band_db

BAND_DB = {qt.OnnxTarget.QDQ: 1.0, qt.OnnxTarget.ONNXRUNTIME: onnxruntime_band_db(2.0)}
STEPS, BATCH, FEATURES, HIDDEN = 7, 5, 6, 12
WARN = "ignore::quantree.QuantreeWarning"


class Packed(nn.Module):
    """Packs, runs the layer, pads back to the input's length: output and final states."""

    def __init__(self, rnn: nn.RNNBase, enforce_sorted: bool, padding_value: float = 0.0):
        super().__init__()
        self.rnn, self.enforce_sorted, self.padding_value = rnn, enforce_sorted, padding_value

    def forward(self, x: torch.Tensor, lengths: torch.Tensor):
        first = self.rnn.batch_first
        packed = pack_padded_sequence(
            x, lengths, batch_first=first, enforce_sorted=self.enforce_sorted
        )
        out, state = self.rnn(packed)
        out, _ = pad_packed_sequence(
            out,
            batch_first=first,
            padding_value=self.padding_value,
            total_length=x.shape[int(first)],
        )
        return out, state


def _batches(generator: torch.Generator, batch_first: bool, sort: bool, n: int):
    shape = (BATCH, STEPS, FEATURES) if batch_first else (STEPS, BATCH, FEATURES)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, STEPS + 1, (BATCH,), generator=generator)
        lengths[int(torch.randint(0, BATCH, (1,), generator=generator))] = STEPS
        if sort:
            lengths = lengths.sort(descending=True).values
        out.append((torch.randn(shape, generator=generator), lengths))
    return out


# (layer, enforce_sorted): every kind, uni and bidirectional, 1 and 2 layers, sorted and
# unsorted lengths, batch-first and sequence-first
CASES = {
    "lstm-bi2-bf-unsorted": (
        lambda: nn.LSTM(FEATURES, HIDDEN, 2, batch_first=True, bidirectional=True),
        False,
    ),
    "lstm-tf-sorted": (lambda: nn.LSTM(FEATURES, HIDDEN), True),
    "gru-bi2-tf-unsorted": (lambda: nn.GRU(FEATURES, HIDDEN, 2, bidirectional=True), False),
    "gru-2-bf-sorted": (lambda: nn.GRU(FEATURES, HIDDEN, 2, batch_first=True), True),
    "rnn_tanh-bi-bf-unsorted": (
        lambda: nn.RNN(FEATURES, HIDDEN, batch_first=True, bidirectional=True),
        False,
    ),
    "rnn_relu-bi2-tf-sorted": (
        lambda: nn.RNN(FEATURES, HIDDEN, 2, nonlinearity="relu", bidirectional=True),
        True,
    ),
}


@functools.cache
def _quantized(case: str, padding_value: float = 0.0, target: qt.OnnxTarget = qt.OnnxTarget.QDQ):
    """The case's model, its reference graph, example and held-out batches: quantized once
    per file and read by several tests (``export_onnx`` and the rewrite copy the graph)."""
    torch.manual_seed(0)
    build, enforce_sorted = CASES[case]
    model = Packed(build(), enforce_sorted, padding_value).eval()
    generator = torch.Generator().manual_seed(1)
    first = model.rnn.batch_first
    calibration = _batches(generator, first, enforce_sorted, 8)
    held_out = _batches(generator, first, enforce_sorted, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        ref = qt.quantize(
            model,
            calibration[0],
            calibration,
            quantizer=for_onnxruntime() if target is qt.OnnxTarget.ONNXRUNTIME else None,
            progress=False,
            backend="reference",
        )
    return model, ref, calibration[0], held_out


def _output_lsb(ref: torch.fx.GraphModule) -> list[float]:
    """Each output leaf's grid step (its final dequantize's scale)."""
    (outputs,) = [n.args[0] for n in ref.graph.nodes if n.op == "output"]
    steps = []
    for leaf in tree_leaves(outputs):
        assert leaf.target == DEQUANTIZE_PER_TENSOR, leaf.format_node()
        steps.append(float(leaf.args[1]))
    return steps


def _past_length(out: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The positions of a padded output past each sequence's length."""
    steps = torch.arange(out.shape[int(batch_first)])
    past = steps[:, None] >= lengths[None, :]  # [steps, batch]
    return (out.transpose(0, 1) if batch_first else out)[past]


@pytest.mark.filterwarnings(WARN)
@pytest.mark.parametrize("target", list(qt.OnnxTarget), ids=lambda t: t.value)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_layers_run_in_onnx_runtime_as_the_reference_does(case, target, tmp_path):
    model, ref, example, held_out = _quantized(case, target=target)
    first = model.rnn.batch_first
    path = qt.export_onnx(ref, example, tmp_path / "packed.onnx", target=target)
    graph = onnx.load(str(path)).graph
    kind = {"LSTM": "LSTM", "GRU": "GRU", "RNN": "RNN"}[type(model.rnn).__name__]
    layers = [n for n in graph.node if n.op_type in (kind, "DynamicQuantizeLSTM")]
    assert len(layers) == model.rnn.num_layers
    assert all(len(n.input) > 4 and n.input[4] for n in layers)  # sequence_lens given
    if target is qt.OnnxTarget.ONNXRUNTIME and kind == "LSTM":
        assert {n.op_type for n in layers} == {"DynamicQuantizeLSTM"}
    lsb = _output_lsb(ref)
    floats, refs, onnxs = [], [], []
    for args in held_out:  # other lengths than the exported example's
        with torch.no_grad():
            want, expected = tree_leaves(ref(*args)), tree_leaves(model(*args))
        got = run_onnx(path, args)
        assert len(got) == len(want) == 1 + len(tree_leaves(model.rnn(args[0])[1]))
        padding = _past_length(want[0], args[1], first)
        assert padding.numel() > 0 and torch.equal(padding, torch.zeros_like(padding))
        assert torch.equal(_past_length(got[0], args[1], first), padding)
        if target is qt.OnnxTarget.QDQ:
            for g, w, step in zip(got, want, lsb, strict=True):
                assert float((g - w).abs().max()) <= step * 1.001 + 1e-6
        floats.append(expected)
        refs.append(want)
        onnxs.append(got)
    for i in range(len(floats[0])):  # output, then each final state
        f = torch.cat([leaves[i].flatten() for leaves in floats])
        ref_db = float(qt.sqnr(f, torch.cat([leaves[i].flatten() for leaves in refs])))
        onnx_db = float(qt.sqnr(f, torch.cat([leaves[i].flatten() for leaves in onnxs])))
        assert onnx_db >= ref_db - BAND_DB[target], (i, ref_db, onnx_db)


@pytest.mark.filterwarnings(WARN)
@pytest.mark.parametrize("target", list(qt.OnnxTarget), ids=lambda t: t.value)
def test_padding_value_fills_positions_past_each_length(target, tmp_path):
    _, ref, example, held_out = _quantized("lstm-bi2-bf-unsorted", padding_value=-1.5)
    path = qt.export_onnx(ref, example, tmp_path / "padded.onnx", target=target)
    assert any(n.op_type == "Where" for n in onnx.load(str(path)).graph.node)
    for args in held_out:
        with torch.no_grad():
            want = ref(*args)[0]
        got = run_onnx(path, args)[0]
        padding = _past_length(want, args[1], True)
        # the reference quantizes the output after padding: -1.5 on its grid
        assert torch.allclose(padding, torch.full_like(padding, -1.5), atol=_output_lsb(ref)[0])
        assert torch.equal(_past_length(got, args[1], True), padding)


@pytest.mark.parametrize("kind", ["GRU", "RNN"])
def test_gru_and_rnn_with_lengths_run_the_int8_scan_in_onnxruntime_target(kind, tmp_path):
    """At a batch where the int8 ``Scan`` beats the float kernel (``ort_recurrence``), a
    packed GRU/RNN runs it with a per-step mask of the sequences still running: no float
    layer left (nothing named in a warning), the padding exact, the band as for the LSTM."""
    torch.manual_seed(0)
    model = Packed(getattr(nn, kind)(FEATURES, 32, 2, bidirectional=True), False).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(STEPS, 64, FEATURES, generator=g), _lengths(g, 64)) for _ in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        ref = qt.quantize(
            model,
            data[0],
            data[:6],
            quantizer=for_onnxruntime(),
            progress=False,
            backend="reference",
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # nothing left float
        path = qt.export_onnx(
            ref, data[0], tmp_path / "scan.onnx", target=qt.OnnxTarget.ONNXRUNTIME
        )
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Scan" in ops and "DynamicQuantizeMatMul" in ops and kind not in ops
    floats, refs, onnxs = [], [], []
    for args in data[6:]:
        with torch.no_grad():
            want, expected = tree_leaves(ref(*args)), tree_leaves(model(*args))
        got = run_onnx(path, args)
        padding = _past_length(want[0], args[1], False)
        assert padding.numel() > 0 and torch.equal(_past_length(got[0], args[1], False), padding)
        floats.append(expected)
        refs.append(want)
        onnxs.append(got)
    for i in range(len(floats[0])):
        f = torch.cat([leaves[i].flatten() for leaves in floats])
        ref_db = float(qt.sqnr(f, torch.cat([leaves[i].flatten() for leaves in refs])))
        onnx_db = float(qt.sqnr(f, torch.cat([leaves[i].flatten() for leaves in onnxs])))
        assert onnx_db >= ref_db - BAND_DB[qt.OnnxTarget.ONNXRUNTIME], (i, ref_db, onnx_db)


def _lengths(generator: torch.Generator, batch: int) -> torch.Tensor:
    lengths = torch.randint(1, STEPS + 1, (batch,), generator=generator)
    lengths[0] = STEPS
    return lengths


@pytest.mark.filterwarnings(WARN)
def test_free_length_exports_and_runs_at_other_lengths(tmp_path):
    """Captured with a free length: the ONNX model takes batches of other lengths, with
    outputs within one LSB of the reference graph's."""
    torch.manual_seed(0)
    model = SortedPacked().eval()
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(4, 30, 8, generator=g), torch.tensor([30, 24, 17, 9])) for _ in range(4)]
    free = {"x": {1: torch.export.Dim.AUTO}, "lengths": None}
    ref = qt.quantize(
        model, calib[0], calib, backend="reference", dynamic_shapes=free, progress=False
    )
    path = qt.export_onnx(ref, calib[0], tmp_path / "sorted.onnx")
    step = _output_lsb(ref)[0]
    for steps, lengths in ((21, [21, 20, 9, 4]), (40, [33, 33, 2, 1])):
        args = (torch.randn(4, steps, 8, generator=g), torch.tensor(lengths))
        with torch.no_grad():
            want = ref(*args)
        (got,) = run_onnx(path, args)
        assert got.shape == want.shape == (4, steps, 5)
        assert float((got - want).abs().max()) <= step * 1.001 + 1e-6


class PaddedToLongest(nn.Module):
    """Tacotron2's encoder and attention: padded to the longest length (``total_length``
    left out), then added to a broadcast query and passed through tanh."""

    def __init__(self, total_length: int | None = None) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEATURES, HIDDEN, batch_first=True, bidirectional=True)
        self.query = nn.Linear(FEATURES, 2 * HIDDEN)
        self.total_length = total_length

    def forward(self, x: torch.Tensor, lengths: torch.Tensor):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(
            self.rnn(packed)[0], batch_first=True, total_length=self.total_length
        )
        return torch.tanh(out + self.query(x[:, :1]))


@pytest.mark.filterwarnings(WARN)
@pytest.mark.parametrize("target", list(qt.OnnxTarget), ids=lambda t: t.value)
def test_padding_to_the_longest_length_runs_at_every_longest_length(target, tmp_path):
    """The ONNX layer's output (the input's length) is sliced to the lengths' largest value:
    the ONNX model's output has the reference's shape for each batch, within one LSB."""
    torch.manual_seed(0)
    data = _batches(torch.Generator().manual_seed(1), True, False, 4)
    ref = qt.quantize(PaddedToLongest().eval(), data[0], data, progress=False, backend="reference")
    path = qt.export_onnx(ref, data[0], tmp_path / "longest.onnx", target=target)
    step = _output_lsb(ref)[0]
    x = data[1][0]
    for lengths in (data[1][1], torch.tensor([3, 2, 4, 1, 2]), torch.tensor([1, 1, 1, 1, 1])):
        with torch.no_grad():
            want = ref(x, lengths)
        (got,) = run_onnx(path, (x, lengths))
        assert got.shape == want.shape == (BATCH, int(lengths.max()), 2 * HIDDEN)
        if target is qt.OnnxTarget.QDQ:
            assert float((got - want).abs().max()) <= step * 1.001 + 1e-6


@pytest.mark.filterwarnings(WARN)
def test_padding_to_another_length_is_refused_with_the_fix(tmp_path):
    torch.manual_seed(0)
    data = _batches(torch.Generator().manual_seed(1), True, False, 3)
    model = PaddedToLongest(total_length=STEPS + 2).eval()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    with pytest.raises(qt.QuantreeError, match=r"node pad .*pads to 9 steps.*total_length=x"):
        qt.export_onnx(ref, data[0], tmp_path / "other.onnx")


@pytest.mark.filterwarnings(WARN)
@pytest.mark.parametrize("case", ["lstm-bi2-bf-unsorted", "gru-bi2-tf-unsorted"])
def test_rewritten_graph_computes_the_reference_exactly_in_pytorch(case):
    """The rewrite before ONNX: the padded layers with ``sequence_lens`` (run by the custom
    ops' PyTorch implementations, PyTorch's packed layer) give the reference's bits; no
    packing op is left for the exporter."""
    from quantree.backends.onnx.recurrent import rewrite_recurrent
    from quantree.core.graphs import copy_graph_module

    _, ref, _, held_out = _quantized(case, target=qt.OnnxTarget.QDQ)  # the qdq case's cache key
    gm = copy_graph_module(ref)
    assert rewrite_recurrent(gm) == 2  # one per layer
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten._pack_padded_sequence.default not in targets
    assert torch.ops.aten._pad_packed_sequence.default not in targets
    for args in held_out:
        for g, w in zip(tree_leaves(gm(*args)), tree_leaves(ref(*args)), strict=True):
            assert torch.equal(g, w)


class ReadsRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(FEATURES, HIDDEN)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor):
        out = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))[0]
        return torch.relu(out.data)


@pytest.mark.filterwarnings(WARN)
def test_packed_rows_read_by_another_op_are_refused_with_the_fix(tmp_path):
    data = _batches(torch.Generator().manual_seed(1), False, False, 3)
    ref = qt.quantize(ReadsRows().eval(), data[0], data, progress=False, backend="reference")
    with pytest.raises(qt.QuantreeError, match=r"node relu .*reads the packed sequence.*Pad the"):
        qt.export_onnx(ref, data[0], tmp_path / "rows.onnx")
