"""A batch norm no conv/linear absorbed runs natively between int8 grids
(``quantree.channel_affine``, ``csrc/channel_affine.cpp``).

The kernel takes the reference's float steps (dequantize, ATen's eval affine terms, the
output grid), so its codes equal the reference's except where ATen's own multiply-add was
contracted into an FMA and the result sits at a rounding tie: at most one code apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.ops.affine import channel_affine

from support import batches, leaves, run

aten = torch.ops.aten
native = torch.ops.quantree


def reference(x, scale, zp, bn: nn.BatchNorm2d | nn.BatchNorm1d, out_scale, out_zp, relu):
    y = F.batch_norm((x.float() - zp) * scale, bn.running_mean, bn.running_var, bn.weight,
                     bn.bias, False, 0.0, bn.eps)  # fmt: skip
    if relu:
        y = F.relu(y)
    return torch.ops.quantized_decomposed.quantize_per_tensor(
        y, out_scale, out_zp, -128, 127, torch.int8
    )


def warmed(bn):
    torch.manual_seed(1)
    with torch.no_grad():
        bn.running_mean.normal_(0.0, 0.5)
        bn.running_var.uniform_(0.2, 3.0)
        bn.weight.normal_(1.0, 0.5)
        bn.bias.normal_(0.0, 0.5)
    return bn.eval()


@pytest.mark.parametrize(
    ("shape", "layout"),
    [((2, 24, 7, 9), "channels_last"), ((2, 24, 7, 9), "contiguous"), ((5, 12), "2d"),
     ((3, 12, 17), "3d"), ((1, 1, 4, 4), "one channel")],
)  # fmt: skip
@pytest.mark.parametrize("relu", [False, True])
def test_codes_within_one_of_reference(shape, layout, relu):
    torch.manual_seed(0)
    bn = warmed(nn.BatchNorm2d(shape[1]) if len(shape) == 4 else nn.BatchNorm1d(shape[1]))
    x = torch.randint(-128, 128, shape, dtype=torch.int8)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    alpha = (1.0 / torch.sqrt(bn.running_var + torch.tensor(bn.eps))) * bn.weight.detach()
    beta = bn.bias.detach() - bn.running_mean * alpha
    got = channel_affine(x, 0.05, 3, alpha, beta, 0.04, -7, relu)
    want = reference(x, 0.05, 3, bn, 0.04, -7, relu)
    assert got.shape == want.shape and got.stride() == x.stride()
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1
    assert float((diff == 0).float().mean()) >= 0.99


class PreActivation(nn.Module):
    """DenseNet's layer: concatenate, normalise, relu, convolve (nothing to fold into)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.grow = nn.Conv2d(16, 8, 3, padding=1)
        self.norm = warmed(nn.BatchNorm2d(24))
        self.conv = nn.Conv2d(24, 8, 1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        y = torch.cat([y, self.grow(y)], 1)
        return self.conv(F.relu(self.norm(y)))


def test_pre_activation_norm_lowered():
    torch.manual_seed(0)
    data = batches((2, 3, 12, 12), n=4)
    _, ref = run(PreActivation().eval(), data, None)
    low = qt.lower(ref, CPU)
    targets = {n.target for n in low.graph.nodes}
    affine = [n for n in low.graph.nodes if n.target == native.channel_affine.default]
    assert [n.args[-1] for n in affine] == [True]  # the relu fused: no int8 pass of its own
    assert aten.batch_norm.default not in targets and aten.relu.default not in targets
    with torch.no_grad():
        for args in data:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                assert qt.sqnr(want, got) >= 35.0
