"""Capture traces no gradient bookkeeping (issue 24, finding 6).

With parameters that require grad, export's fake tracing also tracks autograd for every op
downstream of them, about half of its dispatches on a recurrent model (whose decomposition
export runs once per time step). Capture exports with the parameters not requiring grad;
the model's flags are left as they were, also when export fails. No timing here:
``benchmarks/quantize_time.py`` measures what it saves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt

SEEN: list[bool] = []


class Recording(nn.Module):
    """Records what its forward sees of its weight's flag (export runs forward in Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Conv1d(20, 16, 3, padding=1)
        self.rnn = nn.LSTM(16, 16, 2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 5)
        self.head.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(self.head.weight.requires_grad)
        out, _ = self.rnn(self.front(x).transpose(1, 2))
        return self.head(out)


def test_export_sees_no_parameter_requiring_grad_and_flags_are_restored() -> None:
    model = Recording().eval()
    x = torch.randn(2, 20, 40)
    SEEN.clear()
    gm = qt.capture(model, (x,))
    assert SEEN == [False]
    assert model.head.weight.requires_grad and not model.head.bias.requires_grad
    assert all(p.requires_grad for name, p in model.named_parameters() if name != "head.bias")
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))  # the same graph: bit-equal to the float model


def test_flags_are_restored_when_export_fails() -> None:
    class Refused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.linear.bias.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).numpy()  # export cannot trace a numpy conversion

    model = Refused()
    with pytest.raises(qt.QuantreeError):
        qt.capture(model, (torch.randn(2, 4),))
    assert model.linear.weight.requires_grad and not model.linear.bias.requires_grad
