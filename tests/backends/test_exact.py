"""Where the int8 kernel is exact, the lowered model equals the reference bit for bit.

With power-of-two scales every dequantized value, product and partial sum of the reference
float graph is exactly representable, so the reference computes the exact integer result
too: linear, linear+relu and conv2d must then match exactly, output for output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.core.graphs import fetch_attr

from support import batches, qd, qparams_of, run

POW2 = qt.Int8Quantizer(
    activations=qt.ActivationPoints.EVERY_OP,  # int8 end to end: the path tested exactly
    activation=qt.QuantSpec(qt.QDtype.INT8, power_of_two=True),
    weight=qt.QuantSpec(
        qt.QDtype.INT8, symmetric=True, axis=0, quant_min=-127, quant_max=127, power_of_two=True
    ),
)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(37, 70), nn.Linear(70, 33), nn.Linear(33, 5)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 20, 3, padding=1)
        self.b = nn.Conv2d(20, 17, (3, 2), stride=(2, 1), padding=(0, 1), dilation=(1, 2))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize(
    ("cls", "shape", "op"),
    [(Mlp, (6, 37), "linear"), (Cnn, (2, 3, 11, 9), "conv2d")],
    ids=["linear", "conv2d"],
)
def test_lowered_equals_reference_exactly(cls, shape, op):
    torch.manual_seed(0)
    model = cls().eval()
    data = batches(shape, n=6)
    _, ref = run(model, data, POW2)
    low = qt.lower(ref, CPU)
    target = getattr(torch.ops.quantree, op).default
    assert sum(n.target == target for n in low.graph.nodes) >= 2
    with torch.no_grad():
        for args in data:
            assert torch.equal(ref(*args), low(*args))


@pytest.mark.parametrize(
    ("cls", "shape"), [(Mlp, (64, 37)), (Cnn, (2, 3, 11, 9))], ids=["linear", "conv2d"]
)
def test_default_quantizer_is_within_one_step(cls, shape):
    """Without power-of-two scales float rounding may flip a rare last bit, never more:
    every element within one output step (LSB), fewer than 0.5% of them off by one."""
    torch.manual_seed(0)
    model = cls().eval()
    data = batches(shape, n=4)
    _, ref = run(model, data)
    low = qt.lower(ref, CPU)
    (output,) = next(n for n in ref.graph.nodes if n.op == "output").args[0]
    assert output.target == qd.dequantize_per_tensor.default
    scale = qparams_of(output)[0]
    off_by_one = total = 0
    with torch.no_grad():
        for args in data:
            steps = (ref(*args) - low(*args)).abs() / scale  # whole numbers up to rounding
            assert steps.max() < 1.5
            off_by_one += int((steps > 0.5).sum())
            total += steps.numel()
    assert off_by_one < 0.005 * total


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 24), nn.Linear(16, 24)

    def forward(self, x):
        y, z = self.a(x), self.b(x)
        return y + z, y * z, y + z[:1]


def test_int8_add_and_mul_equal_reference():
    """Elementwise add/mul use the reference's float arithmetic on dequantized int8."""
    torch.manual_seed(0)
    model = Residual().eval()
    data = batches((5, 16), n=4)
    _, ref = run(model, data)
    low = qt.lower(ref, CPU)
    binary = [n.args[0] for n in low.graph.nodes if n.target == torch.ops.quantree.binary.default]
    for n in low.graph.nodes:  # or the same instructions in a region program (csrc/qt_program.h)
        if n.target == torch.ops.quantree.program.default:
            code = fetch_attr(low, str(n.args[2].target)).tolist()
            binary += [("add", "mul", "sub")[row[4]] for row in code if row[0] == 3]
    assert sorted(binary) == ["add", "add", "mul"]
    with torch.no_grad():
        for args in data:
            for want, got in zip(ref(*args), low(*args), strict=True):
                assert torch.equal(want, got)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        return torch.matmul(torch.softmax(scores, -1), self.v(x))


def test_int8_matmul_of_two_activations():
    torch.manual_seed(0)
    model = Attention().eval()
    data = batches((2, 7, 16), n=4)
    _, pow2 = run(model, data, POW2)
    low = qt.lower(pow2, CPU)
    assert sum(n.target == torch.ops.quantree.matmul.default for n in low.graph.nodes) == 2
    with torch.no_grad():
        for args in data:
            assert torch.equal(pow2(*args), low(*args))
    _, ref = run(model, data)
    with torch.no_grad():
        assert qt.sqnr(ref(*data[0]), qt.lower(ref, CPU)(*data[0])) >= 35.0
