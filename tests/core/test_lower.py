"""Backend values: composition order, finishers and tensor functions under ``+``."""

from __future__ import annotations

import torch
from torch import nn

import quantree as qt

from support import batches, run


def _reference() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    _, ref = run(model, batches((3, 4), n=3))
    return ref


def _recording_backend(name: str, log: list[tuple[str, str]]) -> qt.Backend:
    """A backend whose one rule quantizes a fresh tensor and records whose function ran."""

    def quantize(x: torch.Tensor, params: qt.QParams) -> torch.Tensor:
        log.append(("quantize", name))
        return x

    def rule(ctx: qt.LoweringContext, node: torch.fx.Node) -> bool:
        if node.target is torch.ops.aten.linear.default:
            log.append(("rule", name))
            ctx.quantize(torch.zeros(1), ctx.group_params(0) or _any_params(ctx))
        return False

    return qt.Backend(name, (rule,), quantize=quantize)


def _any_params(ctx: qt.LoweringContext) -> qt.QParams:
    return next(g.qparams for g in ctx.groups.values() if g.qparams is not None)


def test_right_rules_first_each_with_its_own_quantize():
    log: list[tuple[str, str]] = []
    composed = _recording_backend("a", log) + _recording_backend("b", log)
    qt.lower(_reference(), composed)
    first_linear = log[:4]
    assert first_linear == [("rule", "b"), ("quantize", "b"), ("rule", "a"), ("quantize", "a")]


def test_finishers_of_both_sides_run_in_order():
    ran: list[str] = []

    def finisher(tag: str):
        def finish(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            ran.append(tag)
            return gm

        return finish

    left = qt.Backend("left", prepare_module=finisher("left"))
    right = qt.Backend("right", prepare_module=finisher("right"))
    qt.lower(_reference(), left + right)
    assert ran == ["left", "right"]


def test_reference_is_the_identity():
    ref = _reference()
    assert qt.lower(ref, qt.REFERENCE) is ref
