"""1-d convolutions with int16 weights: the native op against the exact integer computation
on every kernel path this CPU has, the lowering from the reference q/dq pattern, and the
recipe's choice (int16 weights where a 1-d convolution reads int16)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import quantree as qt
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.loader import ISA_NAMES, isa_cap, library
from quantree.backends.cpu.ops.conv1d_w16 import conv1d_w16, packed_w16
from quantree.core.specs import QDtype
from quantree.tools.inspection import INT16_WEIGHT_KERNEL, op_statuses, summary

W16 = torch.ops.quantree.conv1d_w16.default


@pytest.fixture(params=["portable", "avx2", "avx512vnni"])
def path(request):
    lib = library()
    if lib.qt_select_isa(ISA_NAMES.index(request.param)) != ISA_NAMES.index(request.param):
        lib.qt_select_isa(isa_cap())
        pytest.skip(f"this CPU has no {request.param} path")
    yield request.param
    lib.qt_select_isa(isa_cap())


def exact(x, x_scale, zp, qmin, qmax, w, scale, bias, stride, pad, dil, groups):
    """The reference quantize, the integer sum (exact in float64: products < 2**31, few of
    them), then the op's epilogue: float32(sum) * scale (+ bias)."""
    inv = torch.tensor(1.0 / x_scale, dtype=torch.float32)
    v = torch.clamp(torch.round(x * inv) + zp, qmin, qmax) - zp
    s = torch.nn.functional.conv1d(v.double(), w.double(), None, stride, pad, dil, groups)
    out = s.float() * scale.view(1, -1, 1)
    return out if bias is None else out + bias.view(1, -1, 1)


def cases(count: int, depthwise: bool = False):
    g = torch.Generator().manual_seed(0)

    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    made = 0
    while made < count:
        groups, cg = [1, 1, 2, 3][r(0, 4)], [1, 3, 8, 150][r(0, 4)]
        if r(0, 3) == 0 or depthwise:  # depthwise
            groups, cg = r(1, 20), 1
        c, oc = cg * groups, (1 if depthwise else r(1, 7)) * groups
        k, stride, dil, pad, length = r(1, 8), r(1, 4), r(1, 3), r(0, 5), r(1, 90)
        if length + 2 * pad < dil * (k - 1) + 1:
            continue
        wide = r(0, 2) == 1
        zp = 0 if wide else r(-128, 128)
        x_scale, qmin, qmax = (0.001, -32768, 32767) if wide else (0.02, -128, 127)
        x = torch.randn(r(1, 3), length, c, generator=g).transpose(1, 2) * (40 if wide else 3)
        if r(0, 2):
            x = x.contiguous()
        w = torch.randint(-32768, 32768, (oc, cg, k), generator=g, dtype=torch.int16)
        if r(0, 4) == 0:  # every weight at an end of its range: the largest sums
            w[:] = [-32768, 32767][r(0, 2)]
        scale = torch.rand(oc, generator=g) * 1e-6
        bias = torch.randn(oc, generator=g) if r(0, 2) else None
        made += 1
        yield x, x_scale, zp, qmin, qmax, w, scale, bias, stride, pad, dil, groups


def test_equals_the_exact_integer_computation(path):
    for x, xs, zp, qmin, qmax, w, scale, bias, stride, pad, dil, groups in cases(60):
        out = conv1d_w16(x, xs, zp, qmin, qmax, packed_w16(w), scale, bias, w.shape[0],
                         [w.shape[2]], [stride], [pad], [dil], groups)  # fmt: skip
        expected = exact(x, xs, zp, qmin, qmax, w, scale, bias, stride, pad, dil, groups)
        assert torch.equal(out, expected), (tuple(x.shape), tuple(w.shape), stride, pad, dil)


def test_depthwise_rows_equal_the_exact_integer_computation(path):
    """One input channel per output channel takes its own loop (tap by tap over a row): the
    exact sums and the epilogue as the panel path gives them, every stride and dilation."""
    for x, xs, zp, qmin, qmax, w, scale, bias, stride, pad, dil, groups in cases(40, True):
        out = conv1d_w16(x, xs, zp, qmin, qmax, packed_w16(w), scale, bias, w.shape[0],
                         [w.shape[2]], [stride], [pad], [dil], groups)  # fmt: skip
        expected = exact(x, xs, zp, qmin, qmax, w, scale, bias, stride, pad, dil, groups)
        assert torch.equal(out, expected), (tuple(x.shape), tuple(w.shape), stride, pad, dil)


def test_rejects_arguments_it_cannot_index_with():
    x, w = torch.randn(1, 4, 10), packed_w16(torch.ones(6, 4, 3, dtype=torch.int16))
    scale = torch.ones(6)
    with pytest.raises(NativeArgumentError, match="weight"):
        conv1d_w16(x, 0.1, 0, -128, 127, w[:, :4], scale, None, 6, [3], [1], [0], [1], 1)
    with pytest.raises(NativeArgumentError, match="int16"):
        conv1d_w16(x, 0.1, -100, -32768, 32767, w, scale, None, 6, [3], [1], [0], [1], 1)
    with pytest.raises(NativeArgumentError, match="groups"):
        conv1d_w16(x, 0.1, 0, -128, 127, w, scale, None, 6, [3], [1], [0], [1], 4)


class ConvModule(nn.Module):
    """A layer norm (so the recipe quantizes only what weights read, at int16) before
    pointwise, depthwise and strided 1-d convolutions with biases, summed unscaled."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.pointwise = nn.Conv1d(16, 32, 1)
        self.depthwise = nn.Conv1d(32, 32, 7, padding=3, groups=32)
        self.strided = nn.Conv1d(32, 16, 3, stride=2, padding=1, dilation=2)

    def forward(self, x):
        y = self.norm(x).transpose(1, 2)
        y = self.depthwise(torch.relu(self.pointwise(y)))
        return self.strided(y)


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


@pytest.fixture(scope="module")
def model_data():
    torch.manual_seed(0)
    model = ConvModule().eval()
    calib = [(torch.randn(2, 40, 16),) for _ in range(4)]
    return model, calib, torch.randn(2, 40, 16)


WIDE = qt.Int8Quantizer(conv1d_weight_dtype=QDtype.INT16)
NARROW = qt.Int8Quantizer(conv1d_weight_dtype=QDtype.INT8)


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_the_recipe_widens_conv1d_weights_and_the_backend_runs_them_natively(model_data):
    model, calib, x = model_data
    with torch.no_grad():
        ref = model(x)
        reference = qt.quantize(
            model, calib[0], calib, quantizer=WIDE, backend=None, progress=False
        )
        lowered = qt.quantize(model, calib[0], calib, quantizer=WIDE, progress=False)
        narrow = qt.quantize(model, calib[0], calib, quantizer=NARROW, progress=False)
        default = qt.quantize(model, calib[0], calib, progress=False)
        ref_out, low_out, narrow_out = reference(x), lowered(x), narrow(x)
    weights = [n for n in reference.graph.nodes if "dequantize_per_channel" in str(n.target)]
    assert any(n.args[-1] == torch.int16 for n in weights)
    assert targets(lowered).count(str(W16)) == 3
    assert str(W16) not in targets(narrow)
    statuses = [o.status for o in op_statuses(lowered) if o.op == str(W16)]
    assert statuses == [INT16_WEIGHT_KERNEL] * 3  # inspect says the weights are 16-bit
    assert f"{INT16_WEIGHT_KERNEL} 3" in summary(lowered)
    assert targets(default) == targets(lowered)  # the default widens them
    # the native op follows the reference graph (a float conv of the same dequantized values)
    assert sqnr(ref_out, low_out) > 90
    # 16-bit weights: the layer's error was its 8-bit weights' (measured 80.2 vs 46.5 dB)
    assert sqnr(ref, low_out) > sqnr(ref, narrow_out) + 10


def test_saves_and_loads_bit_equal(model_data, tmp_path):
    from quantree.backends import load, save

    model, calib, x = model_data
    with torch.no_grad():
        lowered = qt.quantize(model, calib[0], calib, quantizer=WIDE, progress=False)
        path = tmp_path / "w16.pt2"
        save(lowered, path, calib[0])
        loaded = load(path)
        assert torch.equal(loaded(x), lowered(x))


def test_a_bias_16_bit_scales_cannot_hold_stays_float_and_the_suggested_fix_makes_it_int32():
    """16-bit input x 16-bit weight scales: an ordinary bias passes int32 (HDemucs' clamped
    biases cost it 14 dB). convert keeps it float and says to give the layer 8-bit weights;
    following that, the bias is int32 again and nothing is kept float."""
    torch.manual_seed(1)
    model = ConvModule().eval()
    with torch.no_grad():
        model.pointwise.bias.fill_(50.0)
    calib = [(torch.randn(2, 40, 16),) for _ in range(4)]

    def bias_kinds(quantizer: qt.Int8Quantizer) -> tuple[list[str], list[object]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = qt.quantize(model, calib[0], calib, quantizer=quantizer, backend=None,
                              progress=False)  # fmt: skip
        said = [str(w.message) for w in caught if "derived constant(s) float" in str(w.message)]
        (conv,) = [n for n in ref.graph.nodes if n.name == "conv1d"]
        bias = conv.args[2]
        return said, [bias.op, bias.args[-1] if bias.op == "call_function" else None]

    said, kind = bias_kinds(WIDE)
    assert len(said) == 1 and "pointwise_bias" in said[0]
    assert "conv1d_weight_dtype=QDtype.INT8" in said[0]
    assert kind[0] == "get_attr"  # float
    said, kind = bias_kinds(NARROW)  # the fix the warning names
    assert not said and kind == ["call_function", torch.int32]
