"""Elementwise producers of a folded loop's per-step inputs move into its step
(``recurrent/unrolled/sink.py``): the step computes ``exp(A dt_t)`` from ``dt_t`` and the
``[B, D, T, N]`` tensors a selective scan computes whole before its loop are never made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.recurrent.unrolled import fold
from quantree.recurrent.unrolled.step_loop import StepLoop

from support import selective_scan

aten = torch.ops.aten


class OuterScan(nn.Module):
    """Mamba-1's sequential scan in miniature: decay ``exp(A dt)`` and drive ``dt B x`` made
    whole as ``[B, D, T, N]`` (outer products of ``[B, D, T]`` and ``[D, N]`` / ``[B, T, N]``),
    then one ``[B, D, N]`` slice of each read a step. ``exact``: no ``exp``/``softplus`` (its
    ops are products and sums only, so computed per step they are the same bits)."""

    def __init__(self, exact: bool = False, variant: str = "") -> None:
        super().__init__()
        self.a_log = nn.Parameter(torch.randn(4, 3))
        self.proj = nn.Linear(5, 4)
        self.exact, self.variant = exact, variant

    def forward(self, x: torch.Tensor):  # [B, T, 5]
        dt = self.proj(x).transpose(1, 2)  # [B, 4, T]
        if not self.exact:
            dt = nn.functional.softplus(dt)
        a = -torch.exp(self.a_log)  # [4, 3]
        decay = a[None, :, None, :] * dt[..., None]  # [B, 4, T, 3]
        if self.variant == "cumsum":  # not elementwise along the steps: stays outside
            decay = decay.cumsum(2) * 0.1
        if not self.exact:
            decay = torch.exp(decay)
        drive = dt[..., None] * x[:, None, :, :3]  # [B, 4, T, 3]
        y = selective_scan(decay, drive, x)
        if self.variant == "shared":  # drive has another reader: it stays outside
            return y, drive.sum(-1)
        return y


def _folded(model: nn.Module, x: torch.Tensor, dynamic_batch: bool = False) -> torch.fx.GraphModule:
    return qt.capture(model, (x,), fold_loops=True, dynamic_batch=dynamic_batch)


def _step_targets(gm: torch.fx.GraphModule) -> list:
    loops = [m for m in gm.modules() if isinstance(m, StepLoop)]
    assert len(loops) == 1
    return [n.target for n in loops[0].body.graph.nodes if n.op == "call_function"]


def _whole(gm: torch.fx.GraphModule) -> list[str]:
    """The main graph's nodes holding a [B, D, T, N] tensor (the scan's whole inputs; not
    the [1, D, 1, N] or [B, D, T, 1] views of smaller ones that broadcast to it)."""
    shapes = [
        (n.name, v.shape)
        for n in gm.graph.nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor)
    ]
    return [name for name, s in shapes if len(s) == 4 and s[1] == 4 and s[2] == 9 and s[3] == 3]


@pytest.mark.parametrize("exact", [True, False])
def test_elementwise_producers_move_into_the_step_and_the_loop_runs_at_any_length(
    exact, monkeypatch
):
    torch.manual_seed(0)
    model = OuterScan(exact).eval()
    x = torch.randn(2, 9, 5)
    gm = _folded(model, x)
    assert _whole(gm) == []  # no [B, D, T, N] tensor is made before the loop
    step = _step_targets(gm)
    assert step.count(aten.mul.Tensor) == 3  # a dt_t, dt_t x_t, decay_t state
    assert (aten.exp.default in step) == (not exact)
    assert (aten.softplus.default in step) == (not exact)
    with monkeypatch.context() as m:  # the loop as the fold made it before producers moved
        m.setattr(fold, "sink_producers", lambda *a: 0)
        before = _folded(model, x)
    assert len(_whole(before)) >= 2  # decay and drive (and views of them)
    for length in (1, 4, 9, 40):  # captured at 9
        y = torch.randn(2, length, 5)
        with torch.no_grad():
            want, got, old = model(y), gm(y), before(y)
        if exact:  # products and sums, in the same order: the same bits
            assert torch.equal(got, want) and torch.equal(got, old)
        else:  # exp / softplus of a slice against of the whole: the same up to rounding
            assert (got - want).abs().max() <= 1e-6 * want.abs().max()
            assert (got - old).abs().max() <= 1e-6 * old.abs().max()


def test_a_producer_with_another_reader_or_not_elementwise_along_the_steps_stays_outside():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 5)
    shared = OuterScan(True, "shared").eval()
    gm = _folded(shared, x)
    drive = [n for n in gm.graph.nodes if n.name in _whole(gm)]
    assert len(drive) == 1 and len(drive[0].users) == 2  # the loop and the sum read it whole
    assert _step_targets(gm).count(aten.mul.Tensor) == 2  # decay moved in, drive did not
    y = torch.randn(2, 13, 5)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(gm(y), shared(y), strict=True))

    summed = OuterScan(False, "cumsum").eval()
    gm = _folded(summed, x)
    cumsum = [n for n in gm.graph.nodes if n.target == aten.cumsum.default]
    assert len(cumsum) == 1  # computed whole, before the loop; the exp after it moved in
    assert aten.exp.default in _step_targets(gm)
    assert aten.cumsum.default not in _step_targets(gm)
    with torch.no_grad():
        want, got = summed(y), gm(y)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_an_outer_product_over_a_batch_left_to_vary_stays_outside():
    """Programs broadcast over fixed sizes only: with a dynamic batch, the products that
    broadcast ``dt`` against ``A`` and ``x`` stay outside (the step would run in Python), the
    ``exp`` after one still moves in."""
    torch.manual_seed(0)
    model = OuterScan().eval()
    gm = _folded(model, torch.randn(2, 9, 5), dynamic_batch=True)
    assert len(_whole(gm)) == 2  # the two outer products, made whole
    assert aten.exp.default in _step_targets(gm)
    y = torch.randn(3, 17, 5)
    with torch.no_grad():
        want, got = model(y), gm(y)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
