"""A folded step's bool mask inputs read as float 0/1 (``backends/cpu/cells/float_masks.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends.cpu.cells import step_program
from quantree.backends.cpu.cells.float_masks import float_masks
from quantree.backends.cpu.cells.step_program import NativeProgramLoop
from quantree.recurrent.unrolled.step_loop import StepLoop


class ResetScan(nn.Module):
    """RecurrentGemma's RG-LRU with its reset mask: ``a * ~reset`` times the state, the mask a
    bool tensor made from the input before the loop and read after it too (so the comparison
    stays outside; the gate and the negation move into the folded step:
    ``recurrent/unrolled/sink.py``)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 8)
        self.inp = nn.Linear(6, 8)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 6]
        g, u = self.gate(x), self.inp(x)
        reset = u > 0.5
        decay = torch.sigmoid(g)
        # where: a mask read otherwise than as a factor, which stays bool
        a = torch.where(reset, torch.zeros_like(decay), decay) if self.where else decay * ~reset
        h = torch.zeros(x.shape[0], 8)
        out = torch.zeros_like(u)
        for t in range(x.shape[1]):
            h = a[:, t] * h + u[:, t]
            out[:, t] = h
        return out * ~reset


def _lowered(model: nn.Module, x: torch.Tensor, native: bool, monkeypatch) -> nn.Module:
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(x.shape, generator=generator),) for _ in range(3)]
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not native:
            m.setattr(step_program, "fuse_regions", lambda *a, **k: 0)
        return qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=True)


def test_a_bool_mask_times_the_gate_runs_as_one_program_with_the_python_loops_bits(monkeypatch):
    torch.manual_seed(0)
    model = ResetScan().eval()
    x = torch.randn(1, 9, 6)
    native = _lowered(model, x, True, monkeypatch)
    python = _lowered(model, x, False, monkeypatch)
    assert [type(m) for m in native.modules() if isinstance(m, NativeProgramLoop)] == [
        NativeProgramLoop
    ]
    loop = next(m for m in python.modules() if isinstance(m, StepLoop))
    bools = [
        p for p in loop.body.graph.nodes
        if p.op == "placeholder" and p.meta["val"].dtype == torch.bool
    ]  # fmt: skip
    assert bools  # the mask is a per-step input of the step left in Python: bool
    for length in (1, 9, 40):  # captured at 9
        y = torch.randn(1, length, 6)
        y[:, ::3] += 2  # some steps reset
        with torch.no_grad():
            assert torch.equal(native(y), python(y))  # 1 - m and x * m: exact
            assert qt.sqnr(model(y), native(y)) > 15  # dB; int8 steps


def test_a_mask_read_otherwise_than_as_a_factor_is_left_bool(monkeypatch):
    torch.manual_seed(0)
    model = ResetScan(where=True).eval()
    x = torch.randn(1, 9, 6)
    python = _lowered(model, x, False, monkeypatch)
    loop = next(m for m in python.modules() if isinstance(m, StepLoop))
    placeholders = [p for p in loop.body.graph.nodes if p.op == "placeholder"]
    assert any(p.meta["val"].dtype == torch.bool for p in placeholders)
    assert float_masks(loop) is None


def test_float_masks_rewrites_a_copy_and_leaves_the_loop_as_it_was(monkeypatch):
    torch.manual_seed(0)
    python = _lowered(ResetScan().eval(), torch.randn(1, 9, 6), False, monkeypatch)
    loop = next(m for m in python.modules() if isinstance(m, StepLoop))
    code = loop.body.code
    masked = float_masks(loop)
    assert masked is not None
    new, indices = masked
    assert loop.body.code == code
    targets = {n.target for n in new.body.graph.nodes}
    assert torch.ops.aten.bitwise_not.default not in targets
    assert torch.ops.aten.rsub.Scalar in targets
    placeholders = [p for p in new.body.graph.nodes if p.op == "placeholder"]
    for i in indices:
        assert placeholders[new.n_states + i].meta["val"].dtype == torch.float32


if __name__ == "__main__":
    pytest.main([__file__])
