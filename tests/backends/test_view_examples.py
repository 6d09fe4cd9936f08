"""An example input that is a view (a slice of a longer batch) exports: torch.export guards
a view's ``_base``, which torch.onnx's and ExecuTorch's decompositions then failed on with a
raw ``AttributeError: 'NoneType' object has no attribute 'size'``."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import quantree as qt

from support import Tokens


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    torch.manual_seed(0)
    data = [(torch.randint(0, 20, (4, 8)),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        return qt.quantize(Tokens().eval(), data[0], data, backend="reference", progress=False)


def _view() -> torch.Tensor:
    view = torch.randint(0, 20, (4, 16))[:, :8]
    assert view._base is not None
    return view


def test_export_onnx_takes_a_view_as_example(reference, tmp_path):
    path = qt.export_onnx(reference, (_view(),), tmp_path / "tokens.onnx")
    assert path.stat().st_size > 0


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="needs executorch")
def test_export_executorch_takes_a_view_as_example(reference, tmp_path):
    path = qt.export_executorch(reference, (_view(),), tmp_path / "tokens.pte")
    assert path.stat().st_size > 0
