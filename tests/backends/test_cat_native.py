"""cat/stack of int8 tensors lower to the join of the integers: equal to the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import calls

aten = torch.ops.aten


class Joins(nn.Module):
    """cat of two linears (one grid), of a sigmoid (its own fixed grid: requantized), stack."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        joined = torch.cat([a, b, torch.sigmoid(b)], -1)
        stacked = torch.stack([a, b], 1).flatten(1)
        return self.c(joined) + stacked.sum(-1, keepdim=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_cat_and_stack_join_int8_and_equal_the_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(5, 8, generator=g),) for _ in range(6)]
    ref = qt.quantize(Joins().eval(), data[0], data, progress=False)
    low = qt.lower(ref, CPU)
    assert not calls(ref, torch.ops.quantree.lookup.default)
    joins = calls(low, aten.cat.default) + calls(low, aten.stack.default)
    assert len(joins) == 2
    for join in joins:  # reads integers: quantize, lookup or a native op, never dequantize
        assert all("dequantize" not in str(a.target) for a in join.args[0])
    assert calls(low, torch.ops.quantree.lookup.default)  # the requantized edge is a table
    with torch.no_grad():
        for args in data:
            assert torch.equal(ref(*args), low(*args))
