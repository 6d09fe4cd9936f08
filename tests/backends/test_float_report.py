"""Lowering names every op left in float, and apart those that dequantize an int8 weight."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU


class Mixed(nn.Module):
    """A native linear, a float layer norm, and a matmul by a folded int8 constant (batched:
    a 2-d ``x @ W.t()`` by a constant is read as a linear since folding runs first)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.a(x)).unsqueeze(0) @ self.w.t().exp().unsqueeze(0)


def _lowering_notes(model: nn.Module) -> list[str]:
    data = [(torch.randn(4, 8),) for _ in range(4)]
    ref = qt.quantize(model.eval(), data[0], data, progress=False, backend="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qt.lower(ref, CPU)
    return [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]


def test_float_ops_are_named_and_no_constant_is_dequantized_per_call() -> None:
    """The matmul's int8 constant is dequantized once at lowering
    (``passes/dequantized_constants.py``): the matmul is named as a float op like any other."""
    notes = _lowering_notes(Mixed())
    assert not [n for n in notes if "dequantize an int8 constant" in n]
    assert sum("aten.matmul.default" in n for n in notes) == 1
    assert sum("layer_norm" in n for n in notes) == 1  # named once, by one of the warnings
    assert not any("linear" in n for n in notes)


class FloatIsland(nn.Module):
    """exp -> cumsum between two float ops: no quantize or dequantize next to cumsum (the
    linear's output, an exponent, is float too: ``recipes/infinities.exponents``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).exp().cumsum(-1).cumsum(-1).log()


def test_ops_inside_a_float_island_are_named() -> None:
    notes = _lowering_notes(FloatIsland())
    island = [n for n in notes if "op(s) compute in float" in n]
    assert len(island) == 1 and "aten.cumsum.default x" in island[0]


def test_a_fully_native_model_lowers_quietly() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert _lowering_notes(model) == []


def test_linear_before_a_float_relu_runs_natively_and_matches_the_reference() -> None:
    """A transformer's FFN under WEIGHTED_INPUTS: linear -> relu (float) -> linear. The
    first linear once stayed float and dequantized its int8 weight on every call."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    data = [(torch.randn(4, 8),) for _ in range(4)]
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    assert not [n for n in low.graph.nodes if n.target == torch.ops.aten.linear.default]
    relus = [n for n in low.graph.nodes if n.target == torch.ops.aten.relu.default]
    assert len(relus) == 1 and "quantree.linear" in str(relus[0].args[0].target)
    with torch.no_grad():
        for args in data:
            assert qt.tools.metrics.sqnr(ref(*args), low(*args)) > 45.0
