"""int8 ``pad`` between int8 kernels (``rules/movement/pad.py``, ``recipes/padding.py``).

Reflect and replicate pads copy int8 codes; a zero fill writes the zero point. In the
lowered graph each pad reads the int8 output of the convolution before it, with no float
pad and no quantize/dequantize around it; a pad of another constant stays float. The
lowered model follows the reference within 35 dB, computes exactly the reference's pad
(the codes are the same), and saves and loads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.checks import NativeArgumentError

aten = torch.ops.aten
PAD_LAST = torch.ops.quantree.pad_last.default


class Padded(nn.Module):
    def __init__(self, fill: float = 0.0) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Conv1d(4, 4, 3) for _ in range(4))
        self.fill = fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(F.pad(self.a(x), (2, 0), mode="reflect"))
        x = self.c(F.pad(x, (1, 1), mode="replicate"))
        return self.d(F.pad(x, (0, 3), value=self.fill))


def _lowered(fill: float = 0.0):
    torch.manual_seed(0)
    data = [(torch.randn(1, 4, 32),) for _ in range(6)]
    ref = qt.quantize(Padded(fill).eval(), data[0], data, backend="reference", progress=False)
    return ref, qt.lower(ref, CPU), data


def _pads(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.target in (aten.pad.default, aten.constant_pad_nd.default, PAD_LAST)
    ]


def test_pads_read_int8_codes() -> None:
    ref, low, data = _lowered()
    pads = _pads(low)
    assert len(pads) == 3
    for pad in pads:
        source = pad.args[0]
        assert "quantree" in str(source.target)  # the int8 conv, no dequantize between
        assert all("quantree" in str(u.target) for u in pad.users)
    assert pads[0].target == pads[1].target == PAD_LAST  # reflect, replicate: native
    assert pads[2].target == aten.constant_pad_nd.default
    with torch.no_grad():
        for args in data:
            assert qt.tools.metrics.sqnr(ref(*args), low(*args)) > 35.0


def test_the_pad_computes_the_reference_codes() -> None:
    x = torch.randint(-128, 128, (1, 4, 9), dtype=torch.int8)
    scale, zp = 0.05, 3
    as_float = (x.float() - zp) * scale
    for mode in ("reflect", "replicate"):
        want = torch.quantize_per_tensor(F.pad(as_float, (2, 1), mode=mode), scale, zp, torch.qint8)
        assert torch.equal(F.pad(x, (2, 1), mode=mode), want.int_repr())
    want = torch.quantize_per_tensor(F.pad(as_float, (0, 3)), scale, zp, torch.qint8)
    assert torch.equal(aten.constant_pad_nd(x, [0, 3], zp), want.int_repr())


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "2-d"])
def test_the_native_pad_equals_aten_on_every_layout(layout) -> None:
    """``quantree.pad_last`` copies codes: equal to ATen's pad element for element, through
    the input's strides, contiguous out; calls it does not take (negative pads, pads ATen
    refuses, other modes) are ATen's, its errors named by the op."""
    x = torch.randint(-128, 128, (2, 5, 9), dtype=torch.int8)
    if layout == "channels_last":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "strided":
        x = torch.randint(-128, 128, (2, 5, 18), dtype=torch.int8)[..., ::2]
    elif layout == "2-d":
        x = x[0]
    for mode in ("reflect", "replicate", "circular"):
        for pad in ([0, 0], [6, 0], [1, 3], [0, 8], [-1, 2], [3, -2]):
            want = aten.pad.default(x, pad, mode)
            got = PAD_LAST(x, pad, mode)
            assert torch.equal(got, want) and got.is_contiguous(), (mode, pad)
    for pad in ([9, 0], [0, 12]):  # reflect needs pads below the length: ATen's error
        with pytest.raises(NativeArgumentError, match="Padding size should be less"):
            PAD_LAST(x, pad, "reflect")
    assert torch.equal(PAD_LAST(x, [12, 1], "replicate"), aten.pad.default(x, [12, 1], "replicate"))


def test_a_pad_of_another_constant_stays_float() -> None:
    _, low, _ = _lowered(fill=1.5)
    (constant,) = [
        n for n in _pads(low) if n.meta.get("val") is not None and n.meta["val"].is_floating_point()
    ]
    assert constant.target == aten.pad.default


def test_saved_and_loaded_it_computes_the_same(tmp_path) -> None:
    _, low, data = _lowered()
    save(low, tmp_path / "pad.pt2", data[0])
    loaded = load(tmp_path / "pad.pt2")
    assert torch.equal(loaded(*data[1]), low(*data[1]))
