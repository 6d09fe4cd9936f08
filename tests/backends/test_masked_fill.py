"""``dq -> masked_fill -> q`` lowers to a select between int8 codes, equal to the reference.

The fill value's code comes from the reference's own quantize (``-inf``, an attention mask's
score, clamps to the lowest code), and the input joins the output grid as it is or through a
requantization table, so the lowered graph equals the reference graph exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import calls

aten = torch.ops.aten


class Masked(nn.Module):
    """Features masked where a length ends, then a layer that reads them quantized."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.score, self.value, self.out = nn.Linear(8, 10), value, nn.Linear(10, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(10).unsqueeze(0) >= lengths.unsqueeze(1)
        return self.out(self.score(torch.tanh(x)).masked_fill(mask, self.value))


@pytest.mark.parametrize("value", [0.0, -3.5, 1e3], ids=["zero", "-3.5", "1e3-clamped"])
def test_masked_fill_is_int8_and_exact(value: float) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 8, generator=g), torch.tensor([4, 10, 7])) for _ in range(8)]
    ref = qt.quantize(Masked(value).eval(), data[0], data, progress=False, backend="reference")
    assert calls(ref, aten.masked_fill.Scalar), "masked_fill is quantized"
    low = qt.lower(ref, CPU)
    assert not calls(low, aten.masked_fill.Scalar)
    assert calls(low, aten.where.self)
    with torch.no_grad():
        for args in data:
            assert torch.equal(ref(*args), low(*args))
