"""conv1d reading and writing ``[N, C, L]`` as it lies (``ops_conv1d.py``): equal bit for bit
to the conv2d-of-height-1 route it replaced, in every layout, form and output kind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.ops.conv1d import conv1d_strided, conv16_small, takes_small
from quantree.backends.cpu.ops.gemm import as_conv2d_geometry, conv2d
from quantree.backends.cpu.ops.wide import LO_ZERO_POINT, split16
from quantree.backends.cpu.rules.linear import pack_conv_weight

quantree_ops = torch.ops.quantree

# (C, O, kernel, stride, padding, dilation, groups): pointwise (the stage is the im2col),
# C not a multiple of 4, taps, strides, asymmetric 'same' padding, dilation, groups of 16
# channels, depthwise with dilation and stride, padding wider than the input
GEOMETRIES = [
    (64, 48, 1, 1, [0], 1, 1),
    (6, 20, 1, 1, [0], 1, 1),
    (5, 24, 5, 2, [2], 1, 1),
    (16, 32, 4, 1, [1, 2], 1, 1),
    (16, 17, 3, 1, [4], 3, 1),
    (32, 32, 3, 2, [1], 1, 2),
    (24, 24, 3, 1, [2], 2, 24),
    (24, 24, 4, 3, [1, 2], 1, 24),
    (3, 8, 2, 1, [9], 1, 1),
]
IDS = [f"c{g[0]}-o{g[1]}-k{g[2]}-s{g[3]}-p{g[4]}-d{g[5]}-g{g[6]}" for g in GEOMETRIES]


def layer(c, o, k, groups, seed=0):
    """A packed int8 weight with per-channel offsets, scales and a bias."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (o, c // groups, k), generator=gen, dtype=torch.int8)
    offset = torch.randint(-5000, 5000, (o,), generator=gen, dtype=torch.int32)
    scale = torch.rand(o, generator=gen) * 1e-3 + 1e-5
    bias = torch.randn(o, generator=gen)
    return pack_conv_weight(values, groups), offset, scale, bias


def old_conv1d(x, w, off, scale, bias, o, k, s, p, d, zp, out_scale, out_zp, relu, groups):
    """What ``quantree.conv1d`` computed before: the conv2d of ``[N, C, 1, L]``."""
    geometry = as_conv2d_geometry([k], [s], p, [d])
    out = conv2d(x.unsqueeze(2), w, off, scale, bias, o, *geometry, zp, out_scale, out_zp,
                 relu, groups)  # fmt: skip
    return out.squeeze(2)


def inputs(n, c, length, dtype):
    """The same values contiguous, channels-last, and as a strided slice."""
    gen = torch.Generator().manual_seed(1)
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (n, c, length), generator=gen, dtype=torch.int8)
    else:
        x = torch.randn(n, c, length, generator=gen)
    last = x.transpose(1, 2).contiguous().transpose(1, 2)
    wider = torch.zeros(n, c, 2 * length, dtype=dtype)
    wider[..., ::2] = x
    return {"contiguous": x, "channels_last": last, "strided": wider[..., ::2]}


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("out", ["float", "int8", "int8-relu"])
def test_int8_conv1d_equals_the_conv2d_route(geometry, out):
    c, o, k, s, p, d, groups = geometry
    w, off, scale, bias = layer(c, o, k, groups)
    out_scale, relu = (0.0, False) if out == "float" else (0.05, out == "int8-relu")
    for name, x in inputs(2, c, 300, torch.int8).items():
        args = (w, off, scale, bias, o, [k], [s], p, [d], 3, out_scale, -7, relu, groups)
        want = old_conv1d(x, *args[:4], o, k, s, p, d, 3, out_scale, -7, relu, groups)
        got = quantree_ops.conv1d(x, *args)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
        if out == "float":  # what a float op reads: no copy needed
            assert got.is_contiguous(), name
        else:  # what the next int8 layer reads without a copy
            assert got.transpose(1, 2).is_contiguous(), name


def old_conv16(x, x_scale, qmin, qmax, w, hi_off, hi_scale, lo_off, lo_scale, bias, o, k, s,
               p, d, groups):  # fmt: skip
    """What ``quantree.conv16`` computed for ``[N, C, L]`` before: two conv2d planes, added."""
    geometry = as_conv2d_geometry([k], [s], p, [d])
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    hi, lo = split16(x4, x_scale, qmin, qmax)
    out = conv2d(hi, w, hi_off, hi_scale, None, o, *geometry, 0, 0.0, 0, False, groups)
    low = conv2d(lo, w, lo_off, lo_scale, bias, o, *geometry, LO_ZERO_POINT, 0.0, 0, False,
                 groups)  # fmt: skip
    return out.add_(low).squeeze(2)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_int16_conv1d_equals_the_two_plane_route(geometry, with_bias):
    c, o, k, s, p, d, groups = geometry
    w, hi_off, hi_scale, bias = layer(c, o, k, groups)
    _, lo_off, lo_scale, _ = layer(c, o, k, groups, seed=2)
    bias = bias if with_bias else None
    x_scale = 4.0 / 32767  # some inputs beyond the range: the clamp is exercised too
    for name, x in inputs(2, c, 257, torch.float32).items():
        args = (w, hi_off, hi_scale, lo_off, lo_scale, bias, o, [k], [s], p, [d], groups)
        want = old_conv16(x, x_scale, -32768, 32767, *args[:6], o, k, s, p, d, groups)
        got = quantree_ops.conv16(x, x_scale, -32768, 32767, *args)
        assert torch.equal(got, want), name
        assert got.is_contiguous(), name


def test_empty_length_and_batch():
    w, off, scale, bias = layer(8, 16, 3, 1)
    for shape in ((0, 8, 20), (2, 8, 0)):
        x = torch.zeros(shape, dtype=torch.int8)
        got = quantree_ops.conv1d(x, w, off, scale, bias, 16, [3], [1], [1], [1], 0, 0.0, 0,
                                  False, 1)  # fmt: skip
        assert got.shape == (shape[0], 16, shape[2])


def test_a_wrong_input_dtype_is_named():
    w, off, scale, bias = layer(8, 16, 3, 1)
    x = torch.zeros(1, 8, 10)  # float where the int8 kernel reads int8
    with pytest.raises(qt.QuantreeError, match=r"conv1d: x is torch\.float32"):
        quantree_ops.conv1d(x, w, off, scale, bias, 16, [3], [1], [1], [1], 0, 0.0, 0, False, 1)


class Separator(nn.Module):
    """A TasNet block: pointwise conv, PReLU, group norm, dilated depthwise conv, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv1d(1, 32, 16, stride=8, padding=8)
        self.pw = nn.Conv1d(32, 48, 1)
        self.act = nn.PReLU()
        self.norm = nn.GroupNorm(1, 48)
        self.dw = nn.Conv1d(48, 48, 3, padding=2, dilation=2, groups=48)
        self.out = nn.Conv1d(48, 32, 1)

    def forward(self, x):
        h = self.inp(x)
        y = self.norm(self.act(self.pw(h)))
        return h + self.out(self.norm(self.act(self.dw(y))))


def test_a_group_norm_model_lowers_natively_with_contiguous_float_outputs():
    """Under WEIGHTED_INPUTS (group norm) every conv reads a float input and writes a float
    output for a float op: all native, the outputs contiguous, close to the reference."""
    torch.manual_seed(0)
    model = Separator().eval()
    data = [(torch.randn(2, 1, 400),) for _ in range(4)]
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    convs = [n for n in low.graph.nodes if "conv" in str(n.target)]
    assert len(convs) == 4 and all("quantree" in str(n.target) for n in convs)
    with torch.no_grad():
        want, got = ref(*data[1]), low(*data[1])
    assert got.is_contiguous()
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("quantized", [False, True])
def test_a_geometry_far_beyond_its_input_runs_the_conv2d_route(quantized):
    """A stride and dilation larger than the input, padded to fit, would make the kernel
    stage a span of ~2**30 positions: the call runs as the conv2d of height 1 instead."""
    w, off, scale, bias = layer(8, 16, 2, 1)
    x = inputs(1, 8, 10, torch.int8)["contiguous"]
    big = 1 << 30
    out_scale = 0.05 if quantized else 0.0
    args = (w, off, scale, bias, 16, [2], [big], [big], [big], 0, out_scale, 0, False, 1)
    got = quantree_ops.conv1d(x, *args)
    want = old_conv1d(x, w, off, scale, bias, 16, 2, big, [big], big, 0, out_scale, 0, False, 1)
    assert torch.equal(got, want) and got.shape[2] == 2
    _, lo_off, lo_scale, _ = layer(8, 16, 2, 1, seed=2)
    xf = inputs(1, 8, 10, torch.float32)["contiguous"]
    got16 = quantree_ops.conv16(xf, 1e-3, -32768, 32767, w, off, scale, lo_off, lo_scale, bias,
                                16, [2], [big], [big], [big], 1)  # fmt: skip
    assert got16.is_contiguous() and got16.shape == (1, 16, 2)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    data=st.data(),
    per_group=st.integers(1, 9),
    groups=st.integers(1, 4),
    out_per_group=st.integers(1, 20),
    kernel=st.integers(1, 6),
    stride=st.integers(1, 4),
    dilation=st.integers(1, 3),
    length=st.integers(1, 300),
    batch=st.integers(1, 2),
    wide=st.booleans(),
)
def test_random_geometries_equal_the_old_routes(
    data, per_group, groups, out_per_group, kernel, stride, dilation, length, batch, wide
):
    """Any geometry the lowering can produce (depthwise when one channel a group in and
    out), any layout: the same bits as the conv2d route (int8) or the two-plane route (int16)."""
    c, o = per_group * groups, out_per_group * groups
    extent = dilation * (kernel - 1) + 1
    left = data.draw(st.integers(0, extent), label="left")
    right = data.draw(st.integers(0, extent), label="right")
    if length + left + right < extent:
        right += extent - (length + left + right)
    padding = [left] if left == right else [left, right]
    layout = data.draw(st.sampled_from(["contiguous", "channels_last", "strided"]), label="layout")
    w, off, scale, bias = layer(c, o, kernel, groups)
    geometry = (o, kernel, stride, padding, dilation)
    if wide:
        _, lo_off, lo_scale, _ = layer(c, o, kernel, groups, seed=2)
        x = inputs(batch, c, length, torch.float32)[layout]
        want = old_conv16(x, 1e-3, -32768, 32767, w, off, scale, lo_off, lo_scale, bias,
                          *geometry, groups)  # fmt: skip
        got = quantree_ops.conv16(x, 1e-3, -32768, 32767, w, off, scale, lo_off, lo_scale, bias,
                                  o, [kernel], [stride], padding, [dilation], groups)  # fmt: skip
    else:
        out_scale = data.draw(st.sampled_from([0.0, 0.05]), label="out_scale")
        x = inputs(batch, c, length, torch.int8)[layout]
        want = old_conv1d(x, w, off, scale, bias, *geometry, 5, out_scale, 3, True, groups)
        got = quantree_ops.conv1d(x, w, off, scale, bias, o, [kernel], [stride], padding,
                                  [dilation], 5, out_scale, 3, True, groups)  # fmt: skip
    assert torch.equal(got, want)


# (C, O, kernel, stride, padding, dilation) the tap-by-tap kernel takes (C * kernel * O at
# most SMALL_PRODUCT): HDemucs' residual branch (8 -> 2, kernel 3, dilations 1 and 2; 2 -> 16
# pointwise), its strided first layer, strides with asymmetric padding, padding wider than
# the input, one input channel
SMALL = [
    (8, 2, 3, 1, [1], 1),
    (8, 2, 3, 1, [2], 2),
    (2, 16, 1, 1, [0], 1),
    (1, 8, 8, 4, [2], 1),
    (3, 5, 4, 3, [1, 2], 2),
    (4, 4, 3, 2, [7], 1),
    (1, 1, 1, 1, [0], 1),
]
SMALL_IDS = [f"c{g[0]}-o{g[1]}-k{g[2]}-s{g[3]}-p{g[4]}-d{g[5]}" for g in SMALL]


@pytest.mark.parametrize("geometry", SMALL, ids=SMALL_IDS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_small_int16_conv1d_equals_the_gemm_routes(geometry, with_bias, batch):
    """conv16 of few channels runs tap by tap (``csrc/conv1d_small.cpp``): the same bits as
    the GEMM route it bypasses and as the two-plane route before it, in every layout, with
    inputs beyond the int16 range (the clamp)."""
    c, o, k, s, p, d = geometry
    assert takes_small(c, o, [k], 1)
    w, hi_off, hi_scale, bias = layer(c, o, k, 1)
    _, lo_off, lo_scale, _ = layer(c, o, k, 1, seed=2)
    bias = bias if with_bias else None
    x_scale = 4.0 / 32767
    wide = (x_scale, -32768, 32767, lo_off, lo_scale)
    for name, x in inputs(batch, c, 37, torch.float32).items():
        got = quantree_ops.conv16(x, x_scale, -32768, 32767, w, hi_off, hi_scale, lo_off,
                                  lo_scale, bias, o, [k], [s], p, [d], 1)  # fmt: skip
        gemm = conv1d_strided(x, w, hi_off, hi_scale, bias, o, [k], [s], p, [d], 0, 0.0, 0,
                              False, 1, wide)  # fmt: skip
        old = old_conv16(x, x_scale, -32768, 32767, w, hi_off, hi_scale, lo_off, lo_scale, bias,
                         o, k, s, p, d, 1)  # fmt: skip
        assert torch.equal(got, gemm) and torch.equal(got, old), name
        assert got.is_contiguous() and got.shape == old.shape, name


def test_only_small_ungrouped_products_are_summed_tap_by_tap():
    assert takes_small(8, 2, [3], 1) and takes_small(16, 16, [1], 1)
    assert not takes_small(16, 4, [4], 4)  # grouped: the GEMM per group
    assert not takes_small(8, 8, [3], 8)  # depthwise: its own kernel
    assert not takes_small(16, 32, [3], 1)  # 1536 multiply-adds a position: the GEMM


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    data=st.data(),
    c=st.integers(1, 12),
    o=st.integers(1, 20),
    kernel=st.integers(1, 5),
    stride=st.integers(1, 4),
    dilation=st.integers(1, 3),
    length=st.integers(1, 200),
    batch=st.integers(1, 3),
)
def test_random_small_geometries_equal_the_two_plane_route(
    data, c, o, kernel, stride, dilation, length, batch
):
    extent = dilation * (kernel - 1) + 1
    left = data.draw(st.integers(0, extent), label="left")
    right = data.draw(st.integers(0, extent), label="right")
    if length + left + right < extent:
        right += extent - (length + left + right)
    padding = [left] if left == right else [left, right]
    layout = data.draw(st.sampled_from(["contiguous", "channels_last", "strided"]), label="layout")
    w, off, scale, bias = layer(c, o, kernel, 1)
    _, lo_off, lo_scale, _ = layer(c, o, kernel, 1, seed=2)
    x = inputs(batch, c, length, torch.float32)[layout]
    want = old_conv16(x, 1e-3, -32768, 32767, w, off, scale, lo_off, lo_scale, bias, o, kernel,
                      stride, padding, dilation, 1)  # fmt: skip
    got = conv16_small(x, (1e-3, -32768, 32767, lo_off, lo_scale), w, off, scale, bias, o,
                       [kernel], [stride], padding, [dilation])  # fmt: skip
    assert torch.equal(got, want)
