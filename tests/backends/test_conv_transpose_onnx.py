"""Transposed convolutions in the reference graph export to QDQ ONNX (``ConvTranspose``
between DequantizeLinear nodes, the weight's per-channel axis 1) and ONNX Runtime computes
what the reference graph does, within one output LSB."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install 'quantree[onnx]')")
pytest.importorskip(
    "onnxruntime", reason="ONNX export tests need onnxruntime (pip install 'quantree[onnx]')"
)
pytest.importorskip(
    "onnxscript", reason="ONNX export tests need onnxscript (pip install 'quantree[onnx]')"
)

import onnx
from test_conv_transpose import Decoder, Upsampler

import quantree as qt
from quantree.backends.onnx import run_onnx
from quantree.core.qdq import params_of

from support import batches


@pytest.mark.filterwarnings("ignore::quantree.QuantreeWarning")
@pytest.mark.parametrize(
    ("cls", "shape", "count"), [(Upsampler, (2, 12, 9), 2), (Decoder, (2, 10, 4, 5), 3)]
)
def test_onnx_runtime_matches_reference(cls, shape, count, tmp_path):
    torch.manual_seed(0)
    data = batches(shape, n=6)
    quantizer = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)
    ref = qt.quantize(
        cls().eval(), data[0], data, quantizer=quantizer, progress=False, backend="reference"
    )
    path = qt.export_onnx(ref, data[1], tmp_path / "m.onnx")
    model = onnx.load(str(path))
    assert Counter(n.op_type for n in model.graph.node)["ConvTranspose"] == count
    inits = {i.name for i in model.graph.initializer}
    axes = {
        next((a.i for a in n.attribute if a.name == "axis"), None)
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in inits
    }
    assert 1 in axes  # transposed weights per channel along their axis 1
    (got,) = run_onnx(path, data[1])
    with torch.no_grad():
        want = ref(*data[1])
    (out,) = next(n for n in ref.graph.nodes if n.op == "output").args[0]
    lsb = float(params_of(out, ref).scale.max())
    assert float((got - want).abs().max()) <= lsb * 1.001
