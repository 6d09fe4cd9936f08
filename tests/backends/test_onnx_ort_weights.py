"""The int8 weight layout of the ONNX Runtime target (``backends/onnx/ort_weights.py``).

``R`` (and ``W`` of ``DynamicQuantizeLSTM``) goes onto one scale when its rows' scales are
close, and keeps them per row otherwise; ``W`` of ``DynamicQuantizeMatMul`` keeps quantree's
values and per-row scales; zero points are zeros of their scale's shape. Numerics: ONNX
Runtime's SQNR against the float model at most ``BAND_DB`` below the reference graph's, as
in ``test_onnx_onnxruntime``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install 'quantree[onnx]')")
pytest.importorskip("onnxruntime", reason="ONNX tests need onnxruntime")
pytest.importorskip("onnxscript", reason="ONNX export tests need onnxscript")

import onnx
from onnx import numpy_helper

import quantree as qt
from quantree.backends.onnx import run_onnx
from quantree.backends.onnx.ort_constants import QuantizedConstant
from quantree.backends.onnx.ort_weights import SPREAD_LIMIT, per_tensor

from support import batches, for_onnxruntime, onnxruntime_band_db

BAND_DB = onnxruntime_band_db(0.5)


def _constant(scales: np.ndarray, seed: int = 0) -> QuantizedConstant:
    rng = np.random.default_rng(seed)
    values = rng.integers(-127, 128, size=(*scales.shape, 8)).astype(np.int8)
    return QuantizedConstant(values, scales.astype(np.float32), np.zeros(scales.shape, np.int8))


def test_close_scales_go_onto_the_largest_rows_grid():
    scales = np.array([[0.010, 0.011, 0.012, 0.0115], [0.02, 0.021, 0.019, 0.02]])
    q = _constant(scales)
    got = per_tensor(q)
    assert got is not None
    assert got.scale.shape == (2,) and got.zero_point.shape == (2,) and not got.zero_point.any()
    np.testing.assert_array_equal(got.scale, scales.max(axis=1).astype(np.float32))
    exact = q.values * scales[:, :, None]
    rounded = got.values.astype(np.float64) * got.scale[:, None, None]
    # one rounding on the direction's grid: at most half its step from quantree's value
    assert np.all(np.abs(rounded - exact) <= got.scale[:, None, None] / 2 + 1e-6)
    assert got.values.dtype == np.int8 and np.abs(got.values.astype(int)).max() <= 127


def test_shared_scale_covers_every_direction():
    scales = np.array([[0.010, 0.011, 0.012, 0.0115], [0.011, 0.0105, 0.0118, 0.0119]])
    got = per_tensor(_constant(scales), shared=True)
    assert got is not None
    np.testing.assert_array_equal(got.scale, np.full(2, 0.012, np.float32))


def test_spread_scales_stay_per_row():
    scales = np.array([[0.01, 0.01, 0.01, 0.01], [0.02, 0.0002, 0.02, 0.0002]])
    top, mean_square = 0.02**2, np.mean(scales[1] ** 2)
    assert top > SPREAD_LIMIT * mean_square  # the second direction spreads
    assert per_tensor(_constant(scales)) is None


class Lstm(torch.nn.Module):
    def __init__(self, dead_row: bool = False) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 32, bidirectional=True)
        if dead_row:  # two gate blocks nearly zero: half the rows' scales far below the rest
            with torch.no_grad():
                self.rnn.weight_hh_l0[32:96] *= 1e-3
                self.rnn.weight_hh_l0_reverse[32:96] *= 1e-3

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("dead_row", [False, True], ids=["close", "spread"])
def test_lstm_weight_layout_in_the_export(dead_row, tmp_path):
    torch.manual_seed(0)
    model = Lstm(dead_row).eval()
    data = batches((12, 3, 16), n=6)
    ref = qt.quantize(model, data[0], data[:5], quantizer=for_onnxruntime(), progress=False)
    path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target=qt.OnnxTarget.ONNXRUNTIME)
    exported = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    (lstm,) = [n for n in exported.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    nodes = exported.graph.node
    dequantized = {o for n in nodes if n.op_type == "DequantizeLinear" for o in n.output}
    assert not dequantized & set(lstm.input[1:4])  # weights and biases: never per call
    assert lstm.input[5:7] == ["", ""]  # zero initial states: absent, no zeros made per call
    w, r = inits[lstm.input[1]], inits[lstm.input[2]]
    assert w.dtype == r.dtype == np.int8 and w.shape == (2, 16, 128) and r.shape == (2, 32, 128)
    w_scale, w_zp, r_scale, r_zp = (inits[lstm.input[i]] for i in (8, 9, 10, 11))
    assert w_scale.shape == w_zp.shape == (2,)  # W's rows are alike in both layers
    assert w_scale[0] == w_scale[1]  # one scale shared by both directions
    assert r_scale.shape == r_zp.shape == ((2, 128) if dead_row else (2,))
    assert not w_zp.any() and not r_zp.any()
    with torch.no_grad():
        want, ref_out = model(data[5][0]), ref(data[5][0])
    got = run_onnx(path, data[5])[0]
    ref_db, ort_db = qt.sqnr(want, ref_out), qt.sqnr(want, got)
    assert ort_db >= ref_db - BAND_DB, (ref_db, ort_db)


@pytest.mark.parametrize("dead_rows", [False, True], ids=["close", "spread"])
def test_gru_step_reads_r_on_one_scale(dead_rows, tmp_path):
    """The ``Scan`` body's product reads int8 ``R^T`` with one scale and zero point: rounded
    onto it when the rows' scales are close, else on a scale of 1 followed by a ``Mul`` by
    the rows' scales (quantree's exact values). The input projections outside keep
    quantree's per-row scales."""
    torch.manual_seed(0)
    model = torch.nn.GRU(16, 32).eval()
    if dead_rows:  # the reset and update blocks nearly zero: two thirds of the rows
        with torch.no_grad():
            model.weight_hh_l0[:64] *= 1e-3
    data = batches((12, 64, 16), n=6)  # batch 64: enough work a step for the int8 Scan
    ref = qt.quantize(
        model, data[0], data[:5], quantizer=for_onnxruntime(), dynamic_batch=False, progress=False
    )
    path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", target=qt.OnnxTarget.ONNXRUNTIME)
    exported = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    (scan,) = [n for n in exported.graph.node if n.op_type == "Scan"]
    (body,) = [a.g for a in scan.attribute if a.name == "body"]
    (step,) = [n for n in body.node if n.op_type == "DynamicQuantizeMatMul"]
    assert inits[step.input[1]].dtype == np.int8 and inits[step.input[1]].shape == (32, 96)
    assert inits[step.input[2]].shape == inits[step.input[3]].shape == (1,)
    scaled = [n for n in body.node if n.op_type == "Mul" and step.output[0] in n.input]
    if dead_rows:
        assert float(inits[step.input[2]][0]) == 1.0
        (mul,) = scaled
        (row_scale,) = [inits[i] for i in mul.input if i in inits]
        assert row_scale.shape == (96,) and row_scale.min() < row_scale.max() / 100
    else:
        assert not scaled
    outside = [n for n in exported.graph.node if n.op_type == "DynamicQuantizeMatMul"]
    assert sorted(inits[n.input[2]].shape for n in outside) == [(32,), (64,)]
    with torch.no_grad():
        want, ref_out = model(data[5][0])[0], ref(data[5][0])[0]
    got = run_onnx(path, data[5])[0]
    ref_db, ort_db = qt.sqnr(want, ref_out), qt.sqnr(want, got)
    assert ort_db >= ref_db - BAND_DB, (ref_db, ort_db)
