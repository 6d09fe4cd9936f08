"""A hand-written global layer norm lowered as one native group norm
(``rules/composite/global_norm.py``).

Asteroid's gLN (``gamma * (x - m) / sqrt(var + eps) + beta`` over channels and time) stays
float under ``WEIGHTED_INPUTS``; the CPU backend computes its ten ops as
``quantree.group_norm(x, 1, gamma, beta, eps)``. In the lowered graph no ``mean``, ``pow``,
``sqrt`` or ``div`` is left of it, whichever side of the division gamma is written on; the
result equals the reference's to float rounding (relative 1e-5); a norm over the channels
alone (a cumulative or channel-wise norm) is not a group norm and stays as written.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

aten = torch.ops.aten
NORM_OPS = {aten.mean.dim, aten.pow.Tensor_Scalar, aten.sqrt.default, aten.div.Tensor}


class Norm(nn.Module):
    def __init__(self, channels: int, gamma_first: bool, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(1, channels, 1) + 0.5)
        self.beta = nn.Parameter(torch.randn(1, channels, 1))
        self.gamma_first, self.dims = gamma_first, dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(self.dims, keepdim=True)
        var = (x - mean).pow(2).mean(self.dims, keepdim=True)
        if self.gamma_first:
            return self.gamma * (x - mean) / (var + 1e-8).sqrt() + self.beta
        return (x - mean) / (var + 1e-8).sqrt() * self.gamma + self.beta


class Separator(nn.Module):
    def __init__(self, gamma_first: bool = True, dims: tuple[int, ...] = (1, 2)) -> None:
        super().__init__()
        self.a, self.b = nn.Conv1d(2, 16, 4, 2), nn.Conv1d(16, 8, 1)
        self.norm = Norm(16, gamma_first, dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(torch.relu(self.a(x))))


def _lowered(model: nn.Module):
    torch.manual_seed(0)
    data = [(torch.randn(1, 2, 64) * 3,) for _ in range(6)]
    ref = qt.quantize(model.eval(), data[0], data, backend="reference", progress=False)
    return ref, qt.lower(ref, CPU), data


@pytest.mark.parametrize("gamma_first", [True, False])
def test_the_norm_is_one_group_norm_equal_to_the_reference(gamma_first: bool) -> None:
    torch.manual_seed(1)
    ref, low, data = _lowered(Separator(gamma_first))
    assert not [n for n in low.graph.nodes if n.target in NORM_OPS]
    (norm,) = [n for n in low.graph.nodes if str(n.target) == "quantree.group_norm.default"]
    assert norm.args[1] == 1 and norm.args[4] == pytest.approx(1e-8)
    with torch.no_grad():
        for args in data:  # float rounding of the norm, through the same int16 layer after it
            want, got = ref(*args), low(*args)
            assert qt.tools.metrics.sqnr(want, got) > 60.0


def test_the_group_norm_computes_the_written_norm() -> None:
    torch.manual_seed(2)
    norm = Norm(16, True, (1, 2)).eval()
    x = torch.randn(3, 16, 40) * 2 + 1
    got = torch.ops.quantree.group_norm(
        x, 1, norm.gamma.detach().reshape(16), norm.beta.detach().reshape(16), 1e-8
    )
    torch.testing.assert_close(got, norm(x), rtol=1e-5, atol=1e-5)


def test_a_norm_over_the_channels_alone_stays_as_written() -> None:
    torch.manual_seed(3)
    _, low, _ = _lowered(Separator(dims=(1,)))
    assert not [n for n in low.graph.nodes if str(n.target) == "quantree.group_norm.default"]
    assert [n for n in low.graph.nodes if n.target == aten.sqrt.default]
