"""Grouped conv2d with fewer than 16 output channels a group runs natively
(``csrc/conv_narrow.cpp``: every group's products in one pass, then the GEMM's epilogue).

With power-of-two scales the int32 arithmetic is exact and the epilogue is the GEMM route's,
so the lowered model equals the reference bit for bit; the same file runs on every kernel
path (``QUANTREE_CPU_ISA=portable``, ``QUANTREE_NATIVE_MARCH=x86-64-v3``), and
``test_kernel_check.py`` holds each path to the portable one on random narrow groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_exact import POW2
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import batches, leaves, run

aten = torch.ops.aten
native = torch.ops.quantree


class Narrow(nn.Module):
    """A dense conv, then a narrow grouped one with a fused relu."""

    def __init__(self, channels: int, groups: int, out_per_group: int, **geometry) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.grouped = nn.Conv2d(channels, out_per_group * groups, groups=groups, **geometry)

    def forward(self, x):
        return F.relu(self.grouped(F.relu(self.stem(x))))


CASES = {
    "resnext 4 a group": (128, 32, 4, dict(kernel_size=3, padding=1)),
    "regnet 8 a group, stride 2": (48, 6, 8, dict(kernel_size=3, stride=2, padding=1)),
    "12 a group: two blocks": (24, 2, 12, dict(kernel_size=3, padding=1)),
    "15 a group, 5x3, dilation": (30, 3, 15, dict(kernel_size=(5, 3), dilation=(2, 1), padding=2)),
    "1 a group from 2": (16, 8, 1, dict(kernel_size=1)),
    "6 a group from 3, asymmetric": (9, 3, 6, dict(kernel_size=(1, 3), padding=(0, 1))),
    "wide rows: Kp 1152": (256, 2, 8, dict(kernel_size=3, padding=1)),
}


@pytest.mark.parametrize("quantizer", [POW2, None], ids=["pow2", "int8"])
@pytest.mark.parametrize("case", list(CASES))
def test_narrow_groups_native_and_exact(case, quantizer):
    channels, groups, per_group, geometry = CASES[case]
    torch.manual_seed(0)
    model = Narrow(channels, groups, per_group, **geometry).eval()
    data = batches((2, 3, 19, 17), n=4)  # 2 x 323 pixels: more than one panel of 256
    _, ref = run(model, data, quantizer)
    low = qt.lower(ref, CPU)
    convs = [n for n in low.graph.nodes if n.target == native.conv2d.default]
    assert [n.args[-1] for n in convs] == [1, groups]
    assert aten.conv2d.default not in {n.target for n in low.graph.nodes}
    with torch.no_grad():
        for args in data:
            for want, got in zip(leaves(ref(*args)), leaves(low(*args)), strict=True):
                if quantizer is POW2:  # exact int32 math: bit for bit
                    assert torch.equal(want, got)
                else:  # per-channel float scales: one code of rounding apart at most
                    assert qt.sqnr(want, got) >= 35.0


class FloatOut(nn.Module):
    """A narrow grouped conv whose output only a float op reads."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=8)

    def forward(self, x):
        return torch.log_softmax(self.grouped(x), 1)


WEIGHTED_POW2 = qt.Int8Quantizer(
    activations=qt.ActivationPoints.WEIGHTED_INPUTS,
    weighted_inputs_dtype=qt.QDtype.INT8,
    activation=qt.QuantSpec(qt.QDtype.INT8, power_of_two=True),
    weight=qt.QuantSpec(
        qt.QDtype.INT8, symmetric=True, axis=0, quant_min=-127, quant_max=127, power_of_two=True
    ),
)


@pytest.mark.parametrize("quantizer", [POW2, WEIGHTED_POW2], ids=["int8-out", "float-out"])
def test_narrow_groups_then_float_op(quantizer):
    """int8 out, dequantized for the float op; or (only what weights read quantized) a
    float result straight from the kernel's float epilogue, within float rounding."""
    torch.manual_seed(0)
    data = batches((1, 32, 9, 9), n=3)
    _, ref = run(FloatOut().eval(), data, quantizer)
    low = qt.lower(ref, CPU)
    assert aten.conv2d.default not in {n.target for n in low.graph.nodes}
    with torch.no_grad():
        for args in data:
            want, got = ref(*args), low(*args)
            if quantizer is POW2:
                assert torch.equal(want, got)
            else:
                assert qt.sqnr(want, got) >= 60.0


def test_narrow_groups_conv1d_stay_float():
    """conv1d's ``[N, C, L]`` route runs a GEMM per group: narrow groups stay float there."""
    model = nn.Sequential(nn.Conv1d(8, 32, 3), nn.Conv1d(32, 32, 3, groups=8)).eval()
    torch.manual_seed(0)
    data = batches((1, 8, 40), n=3)
    _, ref = run(model, data, None)
    low = qt.lower(ref, CPU)
    assert aten.conv1d.default in {n.target for n in low.graph.nodes}
