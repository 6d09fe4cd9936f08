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


class TypeAs(nn.Module):
    """Griffin's RMSNorm: ``norm(x).type_as(x)`` on float32, between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.norm(h).type_as(h)).type_as(x.long()) + 0


def test_type_as_of_one_dtype_goes_with_the_same_bits() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 8, generator=g),) for _ in range(4)]
    ref = qt.quantize(TypeAs().eval(), data[0], data, progress=False, backend="reference")
    original = cpu_backend.drop_identity_casts
    cpu_backend.drop_identity_casts = lambda gm: 0  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.drop_identity_casts = original
    low = qt.lower(ref, CPU)
    assert len(calls(plain, aten.type_as.default)) == 2
    (kept,) = calls(low, aten.type_as.default)  # to int64: a cast that computes
    assert kept.meta["val"].dtype == torch.int64
    with torch.no_grad():
        x = torch.randn(3, 8, generator=g)
        assert torch.equal(low(x), plain(x))
