"""RMSNorm written as five ATen ops runs as one op, and in region programs as one
instruction (``lowering_rms_norm``, ``RMS_NORM`` in ``csrc/qt_program.h``).

LLaMA, Mistral and T5 write ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`` times a
weight. The instruction sums the squares in double where ATen sums in float32, so it equals
ATen up to rounding: within ``1e-6`` of the row's largest value, and SQNR >= 80 dB against
the unfused lowered graph once a linear (int16 input grid) reads it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.passes.casts import drop_identity_casts
from quantree.backends.cpu.passes.regions import float_ops_of_code
from quantree.backends.cpu.passes.rms_norm import recognise_rms_norm
from quantree.core.graphs import fetch_attr
from quantree.tools.metrics import sqnr

from support import calls

aten = torch.ops.aten
PROGRAM = torch.ops.quantree.program.default
FIVE = {aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default}


class RMSNorm(nn.Module):
    """As Hugging Face's LlamaRMSNorm writes it."""

    def __init__(self, width: int, eps: float = 1e-6, dim: int = -1) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.eps, self.dim = eps, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        variance = x.pow(2).mean(self.dim, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(torch.float32)


class NormedMLP(nn.Module):
    """Residual blocks of RMSNorm then linears: long enough for one region program.
    ``native``: ``nn.RMSNorm`` (one ``aten.rms_norm``, its default eps) instead."""

    def __init__(self, width: int = 32, native: bool = False) -> None:
        super().__init__()
        norm = (lambda: nn.RMSNorm(width)) if native else (lambda: RMSNorm(width))
        self.norms = nn.ModuleList(norm() for _ in range(3))
        self.ins = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(3))
        self.outs = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ins, self.outs, strict=True):
            x = x + down(torch.relu(up(norm(x))))
        return x


def _data(n: int = 4, shape: tuple[int, ...] = (2, 16, 32)) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(3 * torch.randn(*shape, generator=g),) for _ in range(n)]


def test_five_ops_become_one_rms_norm_with_the_same_values() -> None:
    torch.manual_seed(0)
    model = RMSNorm(32).eval()
    (x,) = _data(1)[0]
    gm = torch.export.export(model, (x,)).module()
    assert drop_identity_casts(gm) == 2  # the second .to(float32) and its check (not the input's)
    assert recognise_rms_norm(gm) == 1
    targets = {n.target for n in gm.graph.nodes}
    assert not FIVE & targets and aten.mul.Tensor not in targets
    (norm,) = calls(gm, aten.rms_norm.default)
    assert norm.args[1] == [32] and norm.args[3] == pytest.approx(1e-6)
    with torch.no_grad():
        want, got = model(x), gm(x)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_a_mean_over_another_dimension_is_not_an_rms_norm() -> None:
    torch.manual_seed(0)
    model = RMSNorm(32, dim=1).eval()
    (x,) = _data(1, (2, 32, 32))[0]
    gm = torch.export.export(model, (x,)).module()
    drop_identity_casts(gm)
    assert recognise_rms_norm(gm) == 0
    assert {n.target for n in gm.graph.nodes} >= FIVE


@pytest.mark.parametrize("native", [False, True], ids=["five_ops", "nn_rms_norm"])
def test_lowered_rms_norms_run_inside_one_program(native: bool) -> None:
    torch.manual_seed(0)
    data = _data()
    recipe = qt.Int8Quantizer(activations=qt.ActivationPoints.WEIGHTED_INPUTS)  # as LLaMA's
    model = NormedMLP(native=native).eval()
    ref = qt.quantize(model, data[0], data, quantizer=recipe, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    (program,) = calls(low, PROGRAM)
    code = fetch_attr(low, str(program.args[2].target))
    assert float_ops_of_code(code)["rms_norm"] == 3
    assert not FIVE & {n.target for n in low.graph.nodes}
    original = cpu_backend.fuse_regions
    cpu_backend.fuse_regions = lambda gm: 0  # type: ignore[assignment]
    try:
        unfused = qt.lower(ref, CPU)
    finally:
        cpu_backend.fuse_regions = original
    assert calls(unfused, aten.rms_norm.default)  # recognised, run by ATen
    with torch.no_grad():
        for (x,) in _data(3):
            assert sqnr(unfused(x), low(x)) >= 80
            assert sqnr(ref(x), low(x)) >= 40


def test_an_rms_norm_weight_shorter_than_its_rows_is_refused() -> None:
    x = torch.randn(2, 4)
    ops = torch.ops.quantree
    code = torch.tensor([[11, 1, 0, 0] + [0] * 8], dtype=torch.int64)
    fcode = torch.tensor([[1e-6] + [0.0] * 7])
    slots = torch.tensor([[0, 0, 0, 4, 4, 2], [0, 1, 0, 4, 4, 2]])
    args = (code, fcode, slots, torch.tensor([0]), torch.tensor([1]), [2, 4], [2], [2, 4], [2])
    (out,) = ops.program([x], [torch.ones(4)], *args, [0])
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (out - want).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(NativeArgumentError):
        ops.program([x], [torch.ones(3)], *args, [0])
