"""Calibration that never reaches part of the graph (a tensor empty in every batch)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt


class Memory(nn.Module):
    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return torch.tanh(m) * 2


class WithMemory(nn.Module):
    """Like Emformer with a zero-length memory: its ops only ever see empty tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.memory = Memory()

    def forward(self, x: torch.Tensor, memory: torch.Tensor):
        return self.lin(x), self.memory(memory)


def _calibrated() -> tuple[nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = WithMemory().eval()
    data = [(torch.randn(8, 4), torch.randn(0, 4)) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    return model, prepared


def test_unobserved_raises_naming_node_scope_cause_and_fix() -> None:
    _, prepared = _calibrated()
    with pytest.raises(qt.QuantreeError) as error:
        qt.convert(prepared)
    message = str(error.value)
    assert "calibration ran but never observed" in message
    assert "tanh" in message and "module memory" in message
    assert "only empty tensors" in message and "Unobserved.FLOAT" in message


def test_unobserved_float_leaves_them_in_float_with_one_warning() -> None:
    model, prepared = _calibrated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = qt.convert(prepared, unobserved=qt.Unobserved.FLOAT)
    floated = [
        w for w in caught if "left in float what calibration never observed" in str(w.message)
    ]
    assert len(floated) == 1 and "tanh" in str(floated[0].message)
    x = (torch.randn(8, 4), torch.randn(0, 4))
    out, memory = reference(*x)
    assert memory.shape == (0, 4)
    assert float(qt.sqnr(model(*x)[0], out)) > 20


def test_unobserved_must_be_the_enum() -> None:
    _, prepared = _calibrated()
    with pytest.raises(qt.QuantreeError, match="Unobserved"):
        qt.convert(prepared, unobserved="float")  # type: ignore[arg-type]
