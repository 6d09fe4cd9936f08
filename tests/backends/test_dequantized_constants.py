"""No lowered model dequantizes a constant int8 weight on every call.

An RMSNorm's ``mul`` by its weight and a ``matmul`` by a transposed weight (Mamba's
``dt_proj.weight @ time_step``) are float ops reading a quantized weight. Lowered, each
reads a float constant computed once from the int8 weight (``passes/dequantized_constants``):
the lowered model is bit-equal to what it computed before (the reference graph), the
reference graph and the user's model are left as they were, and it saves and loads.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.passes.dequantized_constants import fold_dequantized_constants
from quantree.core.qdq import DEQUANTIZE_OPS

from support import assert_no_weight_dequantized_per_call


class NormAndProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.rand(16) + 0.5)
        self.proj = nn.Linear(16, 16)
        self.dt = nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, T, 16]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        h = self.proj(h)
        return (self.dt.t() @ h.transpose(1, 2)).transpose(1, 2)  # [1, T, 4]


def _reference() -> tuple[torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    data = [(torch.randn(1, 8, 16),) for _ in range(4)]
    model = NormAndProjection().eval()
    return qt.quantize(model, data[0], data, backend="reference", progress=False), data


def test_weights_read_by_float_ops_are_dequantized_once() -> None:
    ref, data = _reference()
    before = [n for n in ref.graph.nodes if n.target in DEQUANTIZE_OPS]
    lowered = qt.lower(ref, CPU)
    assert_no_weight_dequantized_per_call(lowered)
    assert [n for n in ref.graph.nodes if n.target in DEQUANTIZE_OPS] == before  # untouched
    with torch.no_grad():
        for args in data:
            assert torch.equal(lowered(*args), lowered(*args))
            assert qt.tools.metrics.sqnr(ref(*args), lowered(*args)) > 40.0


def test_the_fold_is_exact() -> None:
    """On the reference graph itself, folding changes no value."""
    ref, data = _reference()
    copy = deepcopy(ref)
    assert fold_dequantized_constants(copy) >= 2  # the norm's weight and the dt matmul's
    with torch.no_grad():
        for args in data:
            assert torch.equal(ref(*args), copy(*args))


def test_the_helper_fails_on_a_weight_dequantized_per_call() -> None:
    ref, _ = _reference()
    try:
        assert_no_weight_dequantized_per_call(ref)
    except AssertionError as error:
        assert "dequantize an int8 constant per call" in str(error)
    else:
        raise AssertionError("the reference graph dequantizes its weights per call")
