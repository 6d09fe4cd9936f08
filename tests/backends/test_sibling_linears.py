"""int16-input linears of one input joined into one call (``passes/sibling_linears.py``).

The joined call runs the same kernel over the concatenated weight blocks, so every output
column is the same bits as before: the tests assert exact equality.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import quantree as qt
from quantree.backends import cpu_backend, load, save
from quantree.backends.cpu.passes.sibling_linears import merge_sibling_linears

from support import calls

LINEAR16 = torch.ops.quantree.linear16.default
aten = torch.ops.aten


class Branches(nn.Module):
    """Three projections of one normed input (q, k, v as BERT writes them; the default
    recipe gives a layer norm's readers int16 inputs), one of a width that is not a multiple
    of 16, and one more reading another input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 48), nn.Linear(32, 16), nn.Linear(32, 32)
        self.odd, self.other = nn.Linear(32, 20), nn.Linear(48, 16)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        a = self.a(x)
        return torch.cat([a, self.b(x), self.c(x), self.odd(x), self.other(a)], -1)


def test_siblings_become_one_call_with_the_same_bits() -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 5, 32, generator=g),) for _ in range(6)]
    ref = qt.quantize(Branches().eval(), data[0], data, backend="reference", progress=False)
    separate = qt.lower(ref, cpu_backend(attention=False))
    assert len(calls(separate, LINEAR16)) == 5
    joined = copy.deepcopy(separate)
    assert merge_sibling_linears(joined) == 2  # a, b, c as one; odd (20 wide) and other apart
    widths = sorted(int(n.args[8]) for n in calls(joined, LINEAR16))
    assert widths == [16, 20, 96]
    assert len(calls(joined, aten.slice.Tensor)) == 3
    for (x,) in [*data, (torch.randn(2, 5, 32, generator=g),)]:  # another batch size
        assert torch.equal(joined(x), separate(x))


def test_the_default_backend_joins_them_and_saves(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 5, 32, generator=g),) for _ in range(6)]
    ref = qt.quantize(Branches().eval(), data[0], data, backend="reference", progress=False)
    low = qt.lower(ref, cpu_backend())
    assert len(calls(low, LINEAR16)) == 3
    assert torch.equal(low(*data[1]), qt.lower(ref, cpu_backend(attention=False))(*data[1]))
    save(low, tmp_path / "joined.pt2", data[0])
    assert torch.equal(load(tmp_path / "joined.pt2")(*data[2]), low(*data[2]))
