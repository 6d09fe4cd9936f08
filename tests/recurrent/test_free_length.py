"""A recurrent model quantized from examples of one length runs at any length and batch.

torch.export pins the sequence length of ``aten.lstm``/``gru``/``rnn_*`` (their fake kernels
unroll the loop); quantree captures them through ``quantree_capture::rnn`` instead
(``quantree.recurrent.free_length``), in whole and cells mode, reference and lowered, saved
and loaded. Thresholds: every length within 3 dB of the SQNR at the calibration length, and
at least 25 dB against float (the models measure 35-46 dB).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.onnx import onnx_session

SHAPES = [(3, 50), (1, 1), (7, 37), (1, 400), (7, 1)]


class Speech(nn.Module):
    """conv1d front end, then a 2-layer bidirectional recurrent layer, then a linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.rnn = getattr(nn, kind)(8, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        y, _ = self.rnn(x)
        return self.fc(y)


def _sqnr(model: nn.Module, quantized: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float(qt.sqnr(model(x), quantized(x)))


def _quantize(kind: str, mode: qt.RecurrentMode, backend: object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = Speech(kind).eval()
    data = [(torch.randn(3, 50, 8),) for _ in range(4)]
    quantizer = qt.Int8Quantizer(recurrent=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # no length is pinned: no warning
        quantized = qt.quantize(model, data[0], data, quantizer=quantizer, backend=backend)
    return model, quantized


@pytest.mark.parametrize("mode", [qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_lowered_any_length_and_batch_saved_and_loaded(
    kind: str, mode: qt.RecurrentMode, tmp_path: Path
) -> None:
    model, lowered = _quantize(kind, mode, CPU)
    save(lowered, tmp_path / "m.pt2", (torch.randn(3, 50, 8),))
    loaded = load(tmp_path / "m.pt2")
    torch.manual_seed(1)
    at_50 = _sqnr(model, lowered, torch.randn(3, 50, 8))
    for batch, length in SHAPES:
        x = torch.randn(batch, length, 8)
        got = _sqnr(model, lowered, x)
        assert got >= max(25.0, at_50 - 3.0), (batch, length, got, at_50)
        with torch.no_grad():
            assert torch.equal(lowered(x), loaded(x)), (batch, length)


def test_reference_graph_has_a_symbolic_length() -> None:
    model, reference = _quantize("LSTM", qt.RecurrentMode.WHOLE, qt.REFERENCE)
    layers = [n for n in reference.graph.nodes if n.target == torch.ops.aten.lstm.input]
    assert len(layers) == 2  # whole mode splits the two layers
    for rnn in layers:
        batch, length, _ = rnn.args[0].meta["val"].shape
        assert not isinstance(batch, int) and not isinstance(length, int)
    for batch, length in SHAPES:
        assert _sqnr(model, reference, torch.randn(batch, length, 8)) >= 25.0


class Pinned(nn.Module):
    """Reshapes to a constant length: the model itself fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x.reshape(x.shape[0], 50, 8))[0]


class Unpinned(Pinned):
    """The same model written with the fix the warning gives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x.reshape(x.shape[0], -1, 8))[0]


def test_a_pinned_length_is_named_and_its_fix_works() -> None:
    data = [(torch.randn(3, 50, 8),)]
    with pytest.warns(qt.QuantreeWarning, match=r"sequence length of rnn \(length 50\).*-1"):
        qt.quantize(Pinned().eval(), data[0], data, backend=qt.REFERENCE)
    fixed = Unpinned().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        quantized = qt.quantize(fixed, data[0], data, backend=qt.REFERENCE)
    assert quantized(torch.randn(2, 37, 8)).shape == (2, 37, 16)


def test_an_example_of_length_one_is_named_and_its_fix_works() -> None:
    model = nn.GRU(8, 16, batch_first=True).eval()
    with pytest.warns(qt.QuantreeWarning, match="2 or more steps"):
        qt.quantize(model, (torch.randn(3, 1, 8),), [(torch.randn(3, 1, 8),)], backend=qt.REFERENCE)
    data = [(torch.randn(3, 2, 8),)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        quantized = qt.quantize(model, data[0], data, backend=qt.REFERENCE)
    assert quantized(torch.randn(3, 9, 8))[0].shape == (3, 9, 16)


def test_the_shape_error_fix_for_a_fixed_length_works() -> None:
    """dynamic_batch=False fixes every dimension; the call-time error's dynamic_shapes fix
    (which failed at capture for recurrent models before) now captures and runs."""
    torch.manual_seed(0)
    model = Speech("LSTM").eval()
    data = [(torch.randn(3, 50, 8),)]
    fixed = qt.quantize(model, data[0], data, backend=qt.REFERENCE, dynamic_batch=False)
    with pytest.raises(qt.QuantreeError, match=r"dynamic_shapes=\{'x': \{1: torch.export.Dim"):
        fixed(torch.randn(3, 37, 8))
    shapes = {"x": {1: Dim("x_1")}}
    again = qt.quantize(model, data[0], data, backend=qt.REFERENCE, dynamic_shapes=shapes)
    assert _sqnr(model, again, torch.randn(3, 37, 8)) >= 25.0


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_onnx_export_runs_at_any_length_and_batch(kind: str, tmp_path: Path) -> None:
    """The QDQ export of a reference captured at length 50 runs in ONNX Runtime at other
    lengths and batches (the exported graph keeps the captured symbolic dimensions)."""
    pytest.importorskip("onnxruntime")
    _, reference = _quantize(kind, qt.RecurrentMode.WHOLE, qt.REFERENCE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)  # which ops run float there
        path = qt.export_onnx(reference, (torch.randn(3, 50, 8),), tmp_path / "m.onnx")
    session = onnx_session(path)
    name = session.get_inputs()[0].name
    for batch, length in SHAPES:
        x = torch.randn(batch, length, 8)
        (got,) = session.run(None, {name: x.numpy()})
        assert got.shape == (batch, length, 4)
        with torch.no_grad():
            assert float(qt.sqnr(reference(x), torch.from_numpy(got))) >= 30.0, (batch, length)
