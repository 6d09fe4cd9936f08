"""A float sum between int8 grids runs natively (``ops/sum_dim.py``, ``rules/sum_dim.py``).

The op that ``docs/adding-an-op.md`` was followed for: a kernel, an op module, a rule, and a
line each in ``ops.OPS`` and the rule tuple.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.checks import NativeArgumentError

from support import calls

aten = torch.ops.aten
quantree_ops = torch.ops.quantree


class Pooled(nn.Module):
    """A linear, then its outputs summed over one dimension (as a separable attention sums
    its context vector)."""

    def __init__(self, dim: int, keepdim: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 24)
        self.dim, self.keepdim = dim, keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum(dim=self.dim, keepdim=self.keepdim)


@pytest.mark.parametrize(("dim", "keepdim"), [(-1, False), (1, True), (0, False)])
def test_sum_runs_natively_within_one_code_of_the_reference(dim: int, keepdim: bool) -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 7, 16, generator=g),) for _ in range(8)]
    ref = qt.quantize(Pooled(dim, keepdim).eval(), data[0], data, progress=False)
    low = qt.lower(ref, CPU)
    assert len(calls(low, quantree_ops.sum_dim.default)) == 1
    assert not calls(low, aten.sum.dim_IntList)
    (q,) = calls(ref, torch.ops.quantized_decomposed.quantize_per_tensor.default)[-1:]
    step = float(q.args[1])  # the sum's output grid: the reference's float sum rounds at each
    for (x,) in data:  # addition, so a value within rounding of a half may land one code off
        want, got = ref(x), low(x)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= step * 1.001
        assert (got == want).float().mean() > 0.9


def test_sum_dim_is_exact_on_integers() -> None:
    x = torch.tensor([[[-128, 127, 3], [5, -7, 0]]], dtype=torch.int8)  # [1, 2, 3]
    got = quantree_ops.sum_dim(x, 1, False, 0.5, 1, 0.5, -2)
    # (codes - 1) * 0.5 summed over dim 1, then / 0.5 - 2: -128 + 5 - 2 - 2 = -127, ...
    assert got.tolist() == [[-127, 116, -1]]


def test_a_crafted_argument_is_refused() -> None:
    with pytest.raises(NativeArgumentError, match=r"quantree\.sum_dim: x is torch\.float32"):
        quantree_ops.sum_dim(torch.zeros(2, 3), 0, False, 0.1, 0, 0.1, 0)
    with pytest.raises(NativeArgumentError, match="has no dimension 2"):
        quantree_ops.sum_dim(torch.zeros(2, 3, dtype=torch.int8), 2, False, 0.1, 0, 0.1, 0)
    with pytest.raises(NativeArgumentError, match="zero points"):
        quantree_ops.sum_dim(torch.zeros(2, 3, dtype=torch.int8), 0, False, 0.1, 300, 0.1, 0)


def test_saved_and_loaded_it_computes_the_same(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 5, 16, generator=g),) for _ in range(4)]
    low = qt.lower(qt.quantize(Pooled(1, False).eval(), data[0], data, progress=False), CPU)
    save(low, tmp_path / "sum.pt2", data[0])
    loaded = load(tmp_path / "sum.pt2")
    assert torch.equal(loaded(data[1][0]), low(data[1][0]))
