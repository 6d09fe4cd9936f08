"""cat/stack of int8 tensors lower to the join of the integers: equal to the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend

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
    ref = qt.quantize(Joins().eval(), data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)  # int8 joins, run inside a region program (copies of int8 rows)
    original = cpu_backend.fuse_regions
    cpu_backend.fuse_regions = lambda gm: 0  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)  # the same joins, op by op
    finally:
        cpu_backend.fuse_regions = original
    assert not calls(ref, torch.ops.quantree.lookup.default)
    joins = calls(plain, aten.cat.default) + calls(plain, aten.stack.default)
    assert len(joins) == 2
    for join in joins:  # reads integers: quantize, lookup or a native op, never dequantize
        assert all("dequantize" not in str(a.target) for a in join.args[0])
    assert calls(plain, torch.ops.quantree.lookup.default)  # the requantized edge is a table
    with torch.no_grad():
        for args in data:
            assert torch.equal(ref(*args), plain(*args))
            assert torch.equal(ref(*args), low(*args))
