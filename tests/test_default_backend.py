"""``qt.quantize`` returns the fastest model for this machine unless asked otherwise.

Issue 24, finding 1: the one-call API returned the q/dq reference graph (slower than float)
unless ``backend=CPU`` was passed. Now the default is the CPU backend where its kernels load,
the reference graph with one warning where they cannot, and ``backend=None``/``'reference'``
asks for the reference graph. Saved files, ONNX and torch.export work from either.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import load, save
from quantree.backends.cpu.native import loader as native
from quantree.backends.fastest import fastest_backend
from quantree.core.stages import CONVERTED, STAGE_KEY

from support import batches


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6, 5)
    ).eval()


DATA = batches((3, 4, 6), n=6)


def _kernels(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("quantree.")
    ]


@pytest.fixture
def fresh_choice() -> Iterator[None]:
    fastest_backend.cache_clear()
    yield
    fastest_backend.cache_clear()


def test_default_is_the_cpu_backend_where_kernels_load(fresh_choice: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        default = qt.quantize(_model(), DATA[0], DATA, progress=False)
    explicit = qt.quantize(_model(), DATA[0], DATA, progress=False, backend="cpu")
    expected = ["quantree.quantize.default", "quantree.conv1d.default", "quantree.linear.default"]
    expected.append("quantree.dequantize.default")  # conv1d carries the relu
    assert [str(n.target) for n in _kernels(default)] == expected
    assert [str(n.target) for n in _kernels(explicit)] == expected
    with torch.no_grad():
        for (x,) in DATA:
            assert torch.equal(default(x), explicit(x))


@pytest.mark.parametrize("asked", [None, "reference", qt.REFERENCE])
def test_none_or_reference_asks_for_the_reference_graph(asked: object) -> None:
    ref = qt.quantize(_model(), DATA[0], DATA, progress=False, backend=asked)  # type: ignore[arg-type]
    assert ref.meta[STAGE_KEY] == CONVERTED
    assert _kernels(ref) == []
    steps = qt.convert(_calibrated())
    with torch.no_grad():
        assert torch.equal(ref(*DATA[1]), steps(*DATA[1]))


def _calibrated() -> torch.fx.GraphModule:
    prepared = qt.prepare(qt.capture(_model(), DATA[0]), qt.Int8Quantizer())
    qt.calibrate(prepared, DATA, progress=False)
    return prepared


def test_reference_with_one_warning_where_kernels_do_not_load(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_kernels() -> None:
        raise qt.QuantreeError("no C++ compiler found (c++); install one or set CXX")

    monkeypatch.setattr(native, "library", no_kernels)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = qt.quantize(_model(), DATA[0], DATA, progress=False)
        second = qt.quantize(_model(), DATA[0], DATA, progress=False)
    ours = [w for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    assert len(ours) == 1
    message = str(ours[0].message)
    assert "kernels do not load here" in message and "no C++ compiler" in message
    assert "backend='reference'" in message
    for gm in (first, second):
        assert gm.meta[STAGE_KEY] == CONVERTED and _kernels(gm) == []
    # following the warning's fix: asking for the reference explicitly is silent
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        qt.quantize(_model(), DATA[0], DATA, progress=False, backend="reference")


@pytest.mark.parametrize("asked", ["auto", None])
def test_save_load_and_torch_export_from_either(asked: str | None, tmp_path) -> None:
    qmodel = qt.quantize(_model(), DATA[0], DATA, progress=False, backend=asked)
    path = tmp_path / "model.pt2"
    save(qmodel, path, DATA[0])
    loaded = load(path)
    again = torch.export.export(qmodel, DATA[0]).module()
    with torch.no_grad():
        for (x,) in DATA[:3]:
            expected = qmodel(x)
            assert torch.equal(loaded(x), expected)
            assert torch.equal(again(x), expected)


@pytest.mark.parametrize("asked", ["auto", None])
def test_onnx_export_from_either(asked: str | None, tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    from quantree.backends.onnx import run_onnx

    qmodel = qt.quantize(_model(), DATA[0], DATA, progress=False, backend=asked)
    reference = qt.quantize(_model(), DATA[0], DATA, progress=False, backend=None)
    path = qt.export_onnx(qmodel, DATA[0], tmp_path / "model.onnx")
    with torch.no_grad():
        expected = reference(*DATA[2])
    (got,) = run_onnx(path, DATA[2])
    # ONNX Runtime computes the reference graph's float ops in its own order
    assert qt.sqnr(expected, torch.as_tensor(got)) > 40.0


def test_onnx_export_of_a_graph_lowered_by_hand(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    from quantree.backends.onnx import run_onnx

    ref = qt.convert(_calibrated())
    lowered = qt.lower(ref, "cpu")
    path = qt.export_onnx(lowered, DATA[0], tmp_path / "model.onnx")
    (got,) = run_onnx(path, DATA[2])
    with torch.no_grad():
        assert qt.sqnr(ref(*DATA[2]), got) > 40.0
