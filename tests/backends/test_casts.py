"""Casts of computed values to the dtype they have, and export's dtype checks on them, are
dropped at lowering (``lowering_casts``): they compute nothing and cut region programs."""

from __future__ import annotations

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend

from support import calls

aten = torch.ops.aten


class Casts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)  # the caller's input: its check stays
        return self.proj(x).to(torch.float32) * 2


def test_identity_casts_of_computed_values_go_with_the_same_bits() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 8, generator=g),) for _ in range(4)]
    ref = qt.quantize(Casts().eval(), data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    original = cpu_backend.drop_identity_casts
    cpu_backend.drop_identity_casts = lambda gm: 0  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.drop_identity_casts = original
    checks = aten._assert_tensor_metadata.default
    assert len(calls(plain, aten.to.dtype)) == 2 and len(calls(plain, checks)) == 2
    assert len(calls(low, aten.to.dtype)) == 1  # the input's
    assert len(calls(low, checks)) == 1
    (kept,) = calls(low, checks)
    assert kept.args[0].op == "placeholder"
    with torch.no_grad():
        x = torch.randn(3, 8, generator=g)
        assert torch.equal(low(x), plain(x))
