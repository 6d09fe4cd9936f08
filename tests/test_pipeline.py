"""The one-call pipeline equals the step-by-step one; calibration takes any iterable."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import quantree as qt

from support import batches, run


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def test_quantize_equals_the_steps():
    model, data = _model(), batches((4, 6))
    _, stepwise = run(model, data)
    one_call = qt.quantize(model, data[0], data, progress=False)
    with torch.no_grad():
        assert torch.equal(stepwise(*data[0]), one_call(*data[0]))


def test_calibration_accepts_a_dataloader_and_bare_tensors(capsys):
    model, data = _model(), batches((4, 6))
    loader = DataLoader(TensorDataset(torch.cat([d[0] for d in data])), batch_size=4)
    from_loader = qt.quantize(model, data[0], loader)
    from_tensors = qt.quantize(model, data[0], [d[0] for d in data], progress=False)
    with torch.no_grad():
        assert torch.equal(from_loader(*data[0]), from_tensors(*data[0]))
    assert "calibrating" in capsys.readouterr().err


def test_reference_backend_leaves_the_graph_as_convert_made_it():
    model, data = _model(), batches((4, 6))
    _, ref = run(model, data)
    assert qt.lower(ref, qt.REFERENCE) is ref
