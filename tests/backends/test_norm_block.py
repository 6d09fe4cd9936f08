"""A float group norm and the ops after it as one ``quantree.norm_block`` call
(``passes/norm_blocks.py``, ``ops/norm_block.py``).

HDemucs' residual branch (``DConv``: conv, GroupNorm, GELU, conv, GroupNorm, GLU, LayerScale,
``+ x``) stays float between its int16 convolutions; the CPU backend computes each norm with
what follows it as one native call. In the lowered graph no ``group_norm``, ``gelu``, ``glu``,
``mul`` or ``add`` of the branch is left, and the result equals the reference graph's to
float rounding (the norm's sums and the vector erf / sigmoid: SQNR above 60 dB); the op
itself equals the ATen ops it replaces to 1e-5 on every activation, layout and option.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

aten = torch.ops.aten
BRANCH_OPS = {aten.gelu.default, aten.glu.default, aten.mul.Tensor, aten.add.Tensor}
NORM_BLOCK = "quantree.norm_block.default"


class LayerScale(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(channels) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale[:, None] * x


class DConv(nn.Module):
    """torchaudio's HDemucs ``_DConv`` with one layer, as it is written there."""

    def __init__(self, channels: int = 8, hidden: int = 2) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv1d(channels, hidden, 3, padding=1), nn.GroupNorm(1, hidden), nn.GELU(),
            nn.Conv1d(hidden, 2 * channels, 1), nn.GroupNorm(1, 2 * channels), nn.GLU(1),
            LayerScale(channels),
        )  # fmt: skip
        for norm in (self.layers[1], self.layers[4]):
            nn.init.uniform_(norm.weight, 0.5, 1.5)
            nn.init.uniform_(norm.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.branch, self.out = nn.Conv1d(1, 8, 4, 2), DConv(), nn.Conv1d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.branch(torch.relu(self.inp(x))))


def _lowered() -> tuple[torch.nn.Module, torch.nn.Module, list]:
    torch.manual_seed(0)
    model = Model().eval()
    data = [(torch.randn(batch, 1, 130),) for batch in (1, 1, 1, 1)]
    ref = qt.quantize(model, data[0], data, backend="reference", progress=False)
    return ref, qt.lower(ref, CPU), data


def test_the_branch_is_two_norm_blocks_equal_to_the_reference() -> None:
    ref, low, data = _lowered()
    blocks = [n for n in low.graph.nodes if str(n.target) == NORM_BLOCK]
    assert [n.args[5] for n in blocks] == [1, 2]  # GELU after the first norm, GLU after the second
    gelu, glu = blocks
    assert gelu.args[6] is None and gelu.args[7] is None
    assert glu.args[6] is not None and glu.args[7] is not None  # the layer scale and the + x
    left = [n for n in low.graph.nodes if n.target in BRANCH_OPS]
    assert not left, left
    assert not [n for n in low.graph.nodes if "group_norm" in str(n.target)]
    with torch.no_grad():
        for args in data:
            assert qt.tools.metrics.sqnr(ref(*args), low(*args)) > 60.0


def _composed(x, groups, weight, bias, eps, act, scale, residual):
    y = torch.group_norm(x, groups, weight, bias, eps)
    y = (torch.nn.functional.gelu(y), torch.nn.functional.glu(y, 1), y)[act - 1] if act else y
    if scale is not None:
        y = scale.reshape([-1] + [1] * (y.dim() - 2)) * y
    return y if residual is None else residual + y


@pytest.mark.parametrize("act", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 16, 1024), (3, 4, 13), (2, 8, 5, 7), (32, 2, 64)])
@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_op_equals_the_aten_ops(act: int, shape: tuple, extras: bool, layout: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(shape) * 4 + 1
    if layout == "strided":  # a view the kernel does not read: the ATen ops, same values
        x = torch.randn(shape[0], shape[1], *shape[2:], 2)[..., 0] * 4 + 1
    c = shape[1]
    co = c // 2 if act == 2 else c
    weight, bias = torch.rand(c) + 0.5, torch.randn(c)
    scale = torch.rand(co, 1) + 0.1 if extras else None
    residual = torch.randn(shape[0], co, *shape[2:]) if extras else None
    groups = 2 if c % 4 == 0 else 1
    args = (x, groups, weight, bias, 1e-5, act, scale, residual)
    got = torch.ops.quantree.norm_block(*args)
    torch.testing.assert_close(got, _composed(*args), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_before_the_kernel() -> None:
    x = torch.randn(1, 6, 10)
    with pytest.raises(qt.QuantreeError, match="act 3"):
        torch.ops.quantree.norm_block(x, 1, None, None, 1e-5, 3, None, None)
    with pytest.raises(qt.QuantreeError, match="scale"):
        torch.ops.quantree.norm_block(x, 1, None, None, 1e-5, 2, torch.ones(6), None)
    with pytest.raises(qt.QuantreeError, match="residual"):
        torch.ops.quantree.norm_block(x, 1, None, None, 1e-5, 2, None, torch.ones(1, 6, 10))
    with pytest.raises(qt.QuantreeError, match="act 2 on 5"):
        torch.ops.quantree.norm_block(torch.randn(1, 5, 4), 1, None, None, 1e-5, 2, None, None)
