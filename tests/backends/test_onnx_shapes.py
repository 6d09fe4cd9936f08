"""The ONNX export varies a dimension exactly where the reference graph does.

Before: a recurrent reference captured with a dynamic batch exported with the example's
batch fixed (ONNX Runtime refused any other), and a reference captured at a fixed batch but
exported with ``Dim.AUTO`` exported, then failed inside the LSTM at any other batch
(``initial_h must have shape {1,3,5}``: the zero initial state kept the example's batch).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install 'quantree[onnx]')")
pytest.importorskip("onnxruntime", reason="ONNX tests need onnxruntime")
pytest.importorskip("onnxscript", reason="ONNX export tests need onnxscript")

import onnx

import quantree as qt
from quantree.backends.onnx import run_onnx
from quantree.core.qdq import DEQUANTIZE_OPS

from support import batches

WARN = "ignore::quantree.QuantreeWarning"
AUTO = torch.export.Dim.AUTO


def _output_lsbs(ref: torch.fx.GraphModule) -> list[float]:
    out = next(n for n in ref.graph.nodes if n.op == "output")
    lsbs = []
    for leaf in tree_leaves(out.args[0]):
        assert leaf.target in DEQUANTIZE_OPS
        lsbs.append(float(leaf.args[1]))
    return lsbs


def _assert_within_one_lsb(ref, path, args) -> None:
    got = run_onnx(path, args)
    with torch.no_grad():
        want = tree_leaves(ref(*args))
    for g, w, lsb in zip(got, want, _output_lsbs(ref), strict=True):
        assert g.shape == w.shape
        assert float((g - w).abs().max()) <= lsb * 1.001 + 1e-6


@pytest.mark.filterwarnings(WARN)
@pytest.mark.parametrize(
    ("kind", "batch_first"), [("LSTM", False), ("GRU", True)], ids=["lstm", "gru_batch_first"]
)
def test_dynamic_batch_of_the_reference_varies_in_onnx(kind, batch_first, tmp_path):
    torch.manual_seed(0)
    layer = getattr(nn, kind)(8, 5, batch_first=batch_first).eval()
    axis = 0 if batch_first else 1
    shape = [4, 4, 8]
    shape[axis] = 3
    data = batches(tuple(shape), n=4)
    ref = qt.quantize(
        layer, data[0], data, dynamic_shapes=({axis: AUTO},), progress=False, backend="reference"
    )
    path = qt.export_onnx(ref, data[0], tmp_path / "dyn.onnx")
    for batch in (1, 3, 7):
        shape[axis] = batch
        _assert_within_one_lsb(ref, path, (torch.randn(*shape),))


@pytest.mark.filterwarnings(WARN)
def test_length_and_batch_of_a_recurrent_reference_vary_in_onnx(tmp_path):
    """quantree captures an ``nn.LSTM`` without pinning its sequence length
    (``quantree.recurrent.free_length``); the exporter frees it in ONNX as the reference does,
    and writes no numeric ``dim_param`` (which ONNX Runtime read as free)."""
    torch.manual_seed(0)
    layer = nn.LSTM(8, 5, num_layers=2, bidirectional=True).eval()
    data = batches((6, 3, 8), n=4)
    ref = qt.quantize(
        layer,
        data[0],
        data,
        dynamic_shapes=({0: AUTO, 1: AUTO},),
        progress=False,
        backend="reference",
    )
    path = qt.export_onnx(ref, data[0], tmp_path / "dyn.onnx")
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and dims[1].dim_param and dims[2].dim_value == 8
    assert not any(d.dim_param.isdigit() for d in dims)
    for length, batch in ((6, 1), (2, 5), (9, 3)):
        _assert_within_one_lsb(ref, path, (torch.randn(length, batch, 8),))


@pytest.mark.filterwarnings(WARN)
def test_freeing_a_dimension_the_reference_fixed_is_refused_and_the_fix_works(tmp_path):
    torch.manual_seed(0)
    layer = nn.LSTM(8, 5).eval()
    data = batches((4, 3, 8), n=4)
    fixed = qt.quantize(
        layer, data[0], data, dynamic_batch=False, progress=False, backend="reference"
    )
    with pytest.raises(qt.QuantreeError, match=r"input 'input_1' dimension 1 .* fixed at 3"):
        qt.export_onnx(fixed, data[0], tmp_path / "bad.onnx", dynamic_shapes=({1: AUTO},))
    # the fix the message gives: capture with that dimension dynamic, export as is
    ref = qt.quantize(
        layer, data[0], data, dynamic_shapes=({1: AUTO},), progress=False, backend="reference"
    )
    path = qt.export_onnx(ref, data[0], tmp_path / "good.onnx")
    _assert_within_one_lsb(ref, path, (torch.randn(4, 7, 8),))
