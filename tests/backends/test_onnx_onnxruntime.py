"""``target=OnnxTarget.ONNXRUNTIME``: recurrent layers on ONNX Runtime's integer operators.

Structure: LSTM becomes ``com.microsoft.DynamicQuantizeLSTM``, GRU/RNN ``DynamicQuantizeMatMul``
products in a ``Scan``; their weights are int8 initializers read directly (never through a
``DequantizeLinear``, which would dequantize them on every call). Numerics: ONNX Runtime's
SQNR against the float model is at most ``BAND_DB`` below the reference graph's.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install 'quantree[onnx]')")
pytest.importorskip("onnxruntime", reason="ONNX tests need onnxruntime")
pytest.importorskip("onnxscript", reason="ONNX export tests need onnxscript")

import onnx

import quantree as qt
from quantree.backends.onnx import ort_kernels, run_onnx
from quantree_cli import main

from support import batches, for_onnxruntime, onnxruntime_band_db

BAND_DB = onnxruntime_band_db(0.5)
ORT = qt.OnnxTarget.ONNXRUNTIME
INTEGER_OPS = {"DynamicQuantizeLSTM", "DynamicQuantizeMatMul"}
SCAN_BATCH = 64
"""At hidden 32, the batch from which a GRU/RNN step has enough multiply-adds for the int8
``Scan`` (``ort_recurrence.SCAN_MIN_STEP_MACS``)."""


class Layer(nn.Module):
    """A recurrent layer's sequence output and final hidden state."""

    def __init__(self, kind: str, **options: object) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, **options)

    def forward(self, x):
        out, state = self.rnn(x)
        return out, state[0] if isinstance(state, tuple) else state


@functools.cache
def _quantized(kind: str, seq: int = 12, batch: int = 3, dynamic: bool = False, **options):
    """Quantized once per file and argument set (the export copies the graph): the small RNN
    serves both the enum test and its small-layer case."""
    torch.manual_seed(0)
    model = Layer(kind, **options).eval()
    data = batches((seq, batch, 16), n=6)
    shapes = ({1: torch.export.Dim.AUTO},) if dynamic else None
    ref = qt.quantize(
        model,
        data[0],
        data[:5],
        quantizer=for_onnxruntime(),
        dynamic_shapes=shapes,
        dynamic_batch=dynamic,
        progress=False,
    )
    return model, ref, data


def _weights_read_directly(model: onnx.ModelProto) -> None:
    """Every integer op's weight inputs are int8 initializers, none computed per call."""
    inits = {i.name: i for i in model.graph.initializer}
    graphs = [model.graph] + [
        a.g for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
    ]
    count = 0
    for graph in graphs:
        for node in graph.node:
            if node.op_type == "DynamicQuantizeLSTM":
                weights = node.input[1:3]
            elif node.op_type == "DynamicQuantizeMatMul":
                weights = node.input[1:2]
            else:
                continue
            for name in weights:
                assert name in inits, f"{node.op_type} reads {name} from a node"
                assert inits[name].data_type == onnx.TensorProto.INT8
                count += 1
    assert count > 0
    for node in model.graph.node:  # no dequantized weight left anywhere
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            assert len(inits[node.input[0]].dims) < 2, f"{node.name} dequantizes a weight"


def _sqnrs(model, ref, path, args) -> tuple[float, float]:
    with torch.no_grad():
        floats, refs = model(*args), ref(*args)
    got = run_onnx(path, args)
    ref_db = min(qt.sqnr(f, r) for f, r in zip(floats, refs, strict=True))
    ort_db = min(qt.sqnr(f, g) for f, g in zip(floats, got, strict=True))
    return ref_db, ort_db


@pytest.mark.parametrize(
    ("kind", "options", "integer_op", "count"),
    [
        ("LSTM", {"num_layers": 2}, "DynamicQuantizeLSTM", 2),
        ("LSTM", {"bidirectional": True}, "DynamicQuantizeLSTM", 1),
        ("GRU", {}, "Scan", 1),
        ("GRU", {"num_layers": 2, "bidirectional": True}, "Scan", 4),
        ("RNN", {"nonlinearity": "relu"}, "Scan", 1),
    ],
    ids=["lstm_2layers", "lstm_bidirectional", "gru", "gru_bi_2layers", "rnn_relu"],
)
def test_recurrent_layers_run_int8_in_onnx_runtime(kind, options, integer_op, count, tmp_path):
    batch = 3 if kind == "LSTM" else SCAN_BATCH  # a Scan is chosen from this size on
    model, ref, data = _quantized(kind, batch=batch, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # nothing left float to name
        path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target=ORT)
    exported = onnx.load(str(path))
    ops = Counter(n.op_type for n in exported.graph.node)
    assert ops[integer_op] == count
    assert not ops.keys() & {"LSTM", "GRU", "RNN"}
    _weights_read_directly(exported)
    ref_db, ort_db = _sqnrs(model, ref, path, data[5])
    assert ort_db >= ref_db - BAND_DB, (ref_db, ort_db)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_dynamic_batch_in_onnx_runtime(kind, tmp_path):
    model, ref, data = _quantized(kind, dynamic=True, bidirectional=True)
    path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target=ORT)
    for batch in (1, 5):
        args = (torch.randn(12, batch, 16),)
        ref_db, ort_db = _sqnrs(model, ref, path, args)
        assert ort_db >= ref_db - BAND_DB, (batch, ref_db, ort_db)


def test_qdq_export_names_the_float_recurrent_ops(tmp_path):
    _, ref, data = _quantized("GRU", num_layers=2)
    warning = r"2 op\(s\) run in float in this QDQ export.*: GRU .*, GRU "
    with pytest.warns(qt.QuantreeWarning, match=warning):
        path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx")
    ops = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["GRU"] == 2 and not ops.keys() & INTEGER_OPS


def test_target_is_an_enum(tmp_path):
    _, ref, data = _quantized("RNN")
    with pytest.raises(qt.QuantreeError, match=r"qt.OnnxTarget"):
        qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target="onnxruntime")  # type: ignore[arg-type]


def test_sixteen_bit_activations_stay_float_and_are_named(tmp_path):
    """ONNX Runtime's integer operators quantize their input to 8 bits: an A16W8 layer would
    lose the precision its recipe asked for, so it stays float, named in the warning."""
    torch.manual_seed(0)
    model = Layer("LSTM").eval()
    data = batches((12, 3, 16), n=6)
    ref = qt.quantize(model, data[0], data[:5], quantizer=qt.A16W8Quantizer(), progress=False)
    with pytest.warns(qt.QuantreeWarning, match=r"1 op\(s\) run in float .*LSTM .*16-bit input"):
        path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target=ORT)
    exported = onnx.load(str(path))
    ops = Counter(n.op_type for n in exported.graph.node)
    assert ops["LSTM"] == 1 and not ops.keys() & INTEGER_OPS
    inits = {i.name: i for i in exported.graph.initializer}
    lstm = next(n for n in exported.graph.node if n.op_type == "LSTM")
    assert all(inits[w].data_type == onnx.TensorProto.FLOAT for w in lstm.input[1:3])
    ref_db, ort_db = _sqnrs(model, ref, path, data[5])
    assert ort_db >= ref_db - BAND_DB, (ref_db, ort_db)


def test_cli_format_onnxruntime(tmp_path):
    """``quantree quantize --format onnxruntime``: the same export from the command line."""
    torch.manual_seed(0)
    model = Layer("GRU").eval()
    data = batches((12, SCAN_BATCH, 16), n=4)
    torch.export.save(torch.export.export(model, data[0]), tmp_path / "gru.pt2")
    torch.save(data, tmp_path / "data.pt")
    out = tmp_path / "gru.onnx"
    command = [sys.executable, "-m", "quantree_cli", "quantize", str(tmp_path / "gru.pt2")]
    command += ["--calibration", str(tmp_path / "data.pt"), "-o", str(out)]
    command += ["--format", "onnxruntime", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    exported = onnx.load(str(out))
    ops = Counter(n.op_type for n in exported.graph.node)
    assert ops["Scan"] == 1 and ops["GRU"] == 0
    assert "run in float" not in result.stderr
    assert ort_kernels.saturating_ops(exported)  # full-range weights by default
    # --reduce-range, the fix onnx_session names on such CPUs: the same entry point, in this
    # process (the subprocess above already ran the command as a user does)
    narrow = tmp_path / "gru7.onnx"
    command[command.index(str(out))] = str(narrow)
    assert main([*command[3:], "--reduce-range"]) == 0
    assert not ort_kernels.saturating_ops(onnx.load(str(narrow)))


@pytest.mark.parametrize("kind", ["GRU", "RNN"])
def test_small_layer_stays_float_and_is_named(kind, tmp_path):
    """Below ``SCAN_MIN_STEP_MACS`` a step (batch 3, hidden 32) the float kernel beats the
    int8 ``Scan``: the layer keeps float weights (dequantized once, at export), the warning
    names it with the reason, and it computes the reference graph's float simulation."""
    model, ref, data = _quantized(kind)
    with pytest.warns(qt.QuantreeWarning, match=rf"{kind} \S+ \(batch 3, hidden 32: an int8 Scan"):
        path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target=ORT)
    exported = onnx.load(str(path))
    ops = Counter(n.op_type for n in exported.graph.node)
    assert ops[kind] == 1 and not ops.keys() & (INTEGER_OPS | {"Scan"})
    inits = {i.name: i for i in exported.graph.initializer}
    (layer,) = [n for n in exported.graph.node if n.op_type == kind]
    assert all(inits[w].data_type == onnx.TensorProto.FLOAT for w in layer.input[1:3])
    ref_db, ort_db = _sqnrs(model, ref, path, data[5])
    assert ort_db >= ref_db - BAND_DB, (ref_db, ort_db)
