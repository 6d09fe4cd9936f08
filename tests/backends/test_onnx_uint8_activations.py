"""int8 activation pairs written as uint8 from opset 21 (``uint8_activations``).

Cells mode's default int16 cell state, gates and sums need opset 21, where ONNX Runtime's
own int8 -> uint8 move (after its Q/DQ propagation) refused the file at load. The file now
loads with every graph optimization on and computes exactly the reference graph's numbers;
at a lower opset nothing is moved.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install 'quantree[onnx]')")
pytest.importorskip("onnxruntime", reason="ONNX tests need onnxruntime")
pytest.importorskip("onnxscript", reason="ONNX export tests need onnxscript")

import onnx

import quantree as qt
from quantree.backends.onnx import run_onnx

from support import batches


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.out(y)


def _reference(**options: object):
    torch.manual_seed(0)
    model = Tagger().eval()
    data = batches((2, 3, 8), n=2)
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS, **options)
    prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
    qt.calibrate(prepared, data, progress=False)
    return qt.convert(prepared), data


def _zero_point_types(model: onnx.ModelProto) -> set[int]:
    inits = {i.name: i.data_type for i in model.graph.initializer}
    return {
        inits[n.input[2]]
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits
    }


def test_default_cells_export_loads_in_onnx_runtime_and_matches_the_reference(tmp_path) -> None:
    ref, data = _reference()  # int16 cell internals: opset 21
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = qt.export_onnx(ref, data[0], tmp_path / "cells.onnx")
    model = onnx.load(str(path))
    assert onnx.TensorProto.INT8 not in _zero_point_types(model)  # activations moved to uint8
    assert onnx.TensorProto.UINT8 in _zero_point_types(model)
    assert onnx.TensorProto.INT16 in _zero_point_types(model)
    for x in data:  # every ONNX Runtime optimization on (onnx_session's default)
        (got,) = run_onnx(path, x)
        assert torch.equal(got, ref(*x))


def test_int8_activations_stay_int8_below_opset_21(tmp_path) -> None:
    i8 = qt.QDtype.INT8
    ref, data = _reference(cell_state_dtype=i8, gate_dtype=i8, cell_sums_dtype=i8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = qt.export_onnx(ref, data[0], tmp_path / "cells8.onnx", opset=18)
    assert _zero_point_types(onnx.load(str(path))) == {onnx.TensorProto.INT8}
    (got,) = run_onnx(path, data[0])
    assert torch.equal(got, ref(*data[0]))
