"""int8 ``glu`` between int8 kernels (``rules/composite/glu.py``, ``ops/elementwise.glu``).

The recipe quantizes a GLU's input and output (``recipes/int8.UNARY_OPS``); the CPU backend
lowers ``dq -> glu -> q`` to one native pass. The op computes exactly the reference's codes
(the gate's sigmoids tabulated by aten's own ``glu``) in any layout, and keeps a
channels-last input's layout. In the lowered graph each GLU reads the int8 output of the
convolution before it and feeds the next one, with no float ``glu`` and no quantize or
dequantize around it; the lowered model follows the reference within 35 dB, and saves and
loads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.rules.composite.glu import gate_table

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


def _reference(x: torch.Tensor, dim: int, grids: tuple[float, int, float, int]) -> torch.Tensor:
    scale, zp, out_scale, out_zp = grids
    values = qd.dequantize_per_tensor(x, scale, zp, -128, 127, torch.int8)
    return qd.quantize_per_tensor(F.glu(values, dim), out_scale, out_zp, -128, 127, torch.int8)


@pytest.mark.parametrize(
    ("shape", "dim", "channels_last"),
    [((2, 32, 50), 1, False), ((2, 32, 50), 1, True), ((3, 8, 6), -1, False),
     ((4, 10), 0, False), ((2, 6, 3, 5), 1, False)],
)  # fmt: skip
def test_the_op_computes_the_reference_codes(shape, dim, channels_last) -> None:
    torch.manual_seed(0)
    x = torch.randint(-128, 128, shape, dtype=torch.int8)
    if channels_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    for grids in ((0.05, 3, 0.02, -5), (0.3, -128, 0.1, 0), (0.001, 0, 0.0004, 127)):
        got = torch.ops.quantree.glu(x, dim, gate_table(*grids[:2]), *grids)
        assert torch.equal(got, _reference(x, dim, grids))
        if channels_last:  # the layout of the conv output it reads is kept
            assert got.stride(1) == 1


def test_an_odd_dimension_is_refused_naming_the_op() -> None:
    x = torch.zeros(2, 5, dtype=torch.int8)
    with pytest.raises(NativeArgumentError, match=r"quantree\.glu"):
        torch.ops.quantree.glu(x, 1, gate_table(0.1, 0), 0.1, 0, 0.1, 0)


class Gated(nn.Module):
    """Demucs' encoder and decoder layers: conv -> relu -> 1x1 conv -> GLU over channels."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv1d(2, 8, 4, 2), nn.Conv1d(8, 16, 1)
        self.c = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.glu(self.b(torch.relu(self.a(x))), dim=1)
        return F.glu(self.c(x), dim=1)


def _lowered():
    torch.manual_seed(0)
    data = [(torch.randn(1, 2, 64),) for _ in range(6)]
    ref = qt.quantize(Gated().eval(), data[0], data, backend="reference", progress=False)
    return ref, qt.lower(ref, CPU), data


def test_glus_read_and_write_int8_codes() -> None:
    ref, low, data = _lowered()
    assert not [n for n in low.graph.nodes if n.target == aten.glu.default]
    glus = [n for n in low.graph.nodes if str(n.target) == "quantree.glu.default"]
    assert len(glus) == 2
    first, second = glus
    assert str(first.args[0].target) == "quantree.conv1d.default"  # no dequantize between
    assert [str(u.target) for u in first.users] == ["quantree.conv1d.default"]
    assert [str(u.target) for u in second.users] == ["quantree.dequantize.default"]  # output
    with torch.no_grad():
        for args in data:
            assert qt.tools.metrics.sqnr(ref(*args), low(*args)) > 35.0


def test_the_lowered_glu_is_the_reference_within_one_output_step() -> None:
    ref, low, data = _lowered()
    (q,) = [n for n in ref.graph.nodes if n.target == qd.quantize_per_tensor.default
            and n.args[0].target == aten.glu.default and not n.args[0].users.keys() - {n}
            and any(u.op == "output" for d in n.users for u in d.users)]  # fmt: skip
    step = float(q.args[1])
    with torch.no_grad():
        for args in data:
            assert (ref(*args) - low(*args)).abs().max() <= step * 1.0001


def test_saved_and_loaded_it_computes_the_same(tmp_path) -> None:
    _, low, data = _lowered()
    save(low, tmp_path / "glu.pt2", data[0])
    loaded = load(tmp_path / "glu.pt2")
    assert torch.equal(loaded(*data[1]), low(*data[1]))
