"""Global average pooling between int8 grids runs natively (``ops_mean.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)

quantree_ops = torch.ops.quantree
EVERY_OP = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)


def reference(x, x_scale, x_zp, out_scale, out_zp):
    """What the reference graph computes: dequantize, average in float, quantize."""
    y = ((x.float() - x_zp) * x_scale).mean((2, 3))
    return torch.clamp(torch.round(y / out_scale) + out_zp, -128, 127).to(torch.int8)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("shape", [(2, 24, 7, 7), (1, 130, 28, 28), (3, 5, 1, 1), (1, 3, 64, 9)])
def test_within_one_code_of_the_reference_and_exact_on_the_codes(layout, shape):
    """The int32 sums are exact; only the float average rounds (the reference's sum rounds
    at every addition), so a result is the reference's or one code from it, and equal to
    the exact average of the codes rounded onto the grid."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.cat([x, x], dim=3)[..., ::2]
    got = quantree_ops.mean_hw(x, 0.05, 3, 0.01, -2, True)
    assert got.shape == (shape[0], shape[1], 1, 1)
    want = reference(x, 0.05, 3, 0.01, -2)
    assert (got.flatten(1).int() - want.int()).abs().max() <= 1
    exact = (x.double() - 3).sum((2, 3)) * 0.05 / (shape[2] * shape[3]) / 0.01
    assert ((got.flatten(1).double() + 2) - exact.round().clamp(-126, 129)).abs().max() <= 1


class SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        s = torch.sigmoid(self.fc2(torch.relu(self.fc1(nn.functional.adaptive_avg_pool2d(y, 1)))))
        return self.head((y * s).mean((-2, -1)))


def test_squeeze_excite_pooling_is_native_and_close_to_the_reference():
    torch.manual_seed(0)
    model = SqueezeExcite().eval()
    data = [(torch.randn(2, 3, 12, 12),) for _ in range(4)]
    ref = qt.quantize(model, data[0], data, quantizer=EVERY_OP, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    targets = [str(n.target) for n in low.graph.nodes if n.op == "call_function"]
    assert sum("mean_hw" in t for t in targets) == 2
    assert not any("adaptive_avg_pool2d" in t or "aten.mean" in t for t in targets)
    with torch.no_grad():
        want, got = ref(*data[1]), low(*data[1])
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())


def test_a_wrong_input_is_named():
    with pytest.raises(qt.QuantreeError, match=r"mean_hw: x is torch\.float32"):
        quantree_ops.mean_hw(torch.zeros(1, 2, 3, 3), 0.1, 0, 0.1, 0, True)
