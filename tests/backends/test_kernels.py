"""The custom ops on their own: layouts, odd sizes, zero points, fake implementations."""

from __future__ import annotations

import pytest
import torch

from quantree.backends.cpu import ops  # noqa: F401
from quantree.backends.cpu.native.packing import pack, zero_point_offset

quantree_ops = torch.ops.quantree


def random_int8(*shape: int, low: int = -128, high: int = 128) -> torch.Tensor:
    return torch.randint(low, high, shape, dtype=torch.int8)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 4, 16), (3, 5, 17), (7, 64, 100), (33, 130, 64)])
def test_linear_matches_integer_arithmetic(m, k, n):
    torch.manual_seed(k)
    x, w = random_int8(m, k), random_int8(n, k, low=-127)
    zp = 13
    scale = torch.rand(n) * 1e-3
    bias = torch.randn(n)
    acc = (x.int() - zp) @ w.int().t()
    want = acc.float() * scale + bias
    got = quantree_ops.linear(x, pack(w), zero_point_offset(w, zp), scale, bias, n, 0.0, 0, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    q = quantree_ops.linear(x, pack(w), zero_point_offset(w, zp), scale, bias, n, 0.01, -3, True)
    expect = torch.clamp(torch.round(want * (1 / 0.01)) - 3, -3, 127).to(torch.int8)
    assert (q.int() - expect.int()).abs().max() <= 1 and q.dtype == torch.int8


@pytest.mark.parametrize(
    ("c", "kernel", "stride", "padding", "dilation"),
    [
        (3, [3, 3], [1, 1], [1, 1], [1, 1]),  # 9-byte kernel rows (two overlapping words)
        (1, [3, 2], [2, 2], [2, 1], [1, 1]),  # 2-byte kernel rows
        (20, [3, 3], [2, 1], [0, 2], [2, 1]),  # 60-byte kernel rows, dilated vertically
        (5, [5, 5], [3, 3], [2, 2], [1, 1]),
        (4, [2, 4], [1, 2], [1, 0, 2, 1], [1, 1]),  # 16-byte kernel rows, asymmetric padding
        (2, [3, 3], [1, 1], [1, 1], [1, 2]),  # dilated horizontally: tap by tap
    ],
)
def test_conv2d_matches_integer_arithmetic(c, kernel, stride, padding, dilation):
    """Every im2col case (kernel rows inside, at a border, in the padding; panels of 256
    pixels that end inside an output row) gives the exact integer sums of a float conv."""
    torch.manual_seed(c)
    n, h, w, oc, zp = 3, 13, 11, 19, -7
    x, weight = random_int8(n, c, h, w), random_int8(oc, c, *kernel, low=-127)
    flat = weight.permute(0, 2, 3, 1).reshape(oc, -1)  # K ordered (kh, kw, c)
    scale = torch.ones(oc)
    got = quantree_ops.conv2d(x, pack(flat), zero_point_offset(flat, zp), scale, None, oc,
                              kernel, stride, padding, dilation, zp, 0.0, 0, False)  # fmt: skip
    top, left = padding[:2]
    bottom, right = padding[2:] if len(padding) == 4 else padding
    shifted = torch.nn.functional.pad(x.float() - zp, (left, right, top, bottom))  # zp: 0
    want = torch.nn.functional.conv2d(shifted, weight.float(), None, stride, 0, dilation)
    assert got.shape == want.shape and torch.equal(got.contiguous(), want)


@pytest.mark.parametrize(
    ("groups", "c", "size"),
    [
        (1, 5, 20),  # 800 pixels: four panels of im2col, the last one short
        (2, 5, 20),
        (1, 96, 17),  # K = 864: several L2-sized row panels within one panel of pixels
        (3, 96, 12),
    ],
)
def test_grouped_conv2d_over_many_panels_is_exact(groups, c, size):
    """A weight prepared once per call (the AVX2 path's int16 panels) and read by every panel
    of pixels, every group and every row panel gives the exact integer sums, and the same
    sums requantized (a power-of-two scale: exact) with a fused relu."""
    torch.manual_seed(groups * c)
    n, ocg, zp, out_zp = 2, 24, 5, -9  # 24 columns a group: one and a half 16-column blocks
    x = random_int8(n, c * groups, size, size)
    weight = random_int8(ocg * groups, c, 3, 3, low=-127)
    flats = [w.permute(0, 2, 3, 1).reshape(ocg, -1) for w in weight.split(ocg)]
    packed = torch.cat([pack(f) for f in flats])  # the groups one after the other
    offset = torch.cat([zero_point_offset(f, zp) for f in flats])
    geometry = ([3, 3], [1, 1], [1, 1], [1, 1])
    want = torch.nn.functional.conv2d(
        torch.nn.functional.pad(x.float() - zp, (1, 1, 1, 1)), weight.float(), groups=groups
    )
    got = quantree_ops.conv2d(x, packed, offset, torch.ones(ocg * groups), None, ocg * groups,
                              *geometry, zp, 0.0, 0, False, groups)  # fmt: skip
    assert got.shape == want.shape and torch.equal(got.contiguous(), want)
    q = quantree_ops.conv2d(x, packed, offset, torch.ones(ocg * groups), None, ocg * groups,
                            *geometry, zp, 0.25, out_zp, True, groups)  # fmt: skip
    expect = torch.clamp(torch.round(want * 4) + out_zp, out_zp, 127).to(torch.int8)
    assert torch.equal(q.contiguous(), expect)


def seven_bit_conv(weight: torch.Tensor, x: torch.Tensor, zp: int) -> None:
    """A 3x3 conv of 40 channels over 3 im2col panels: the exact integer sums, and the same
    requantized (a power-of-two scale: exact) with a fused relu."""
    oc = weight.shape[0]
    flat = weight.permute(0, 2, 3, 1).reshape(oc, -1)
    geometry = ([3, 3], [1, 1], [1, 1], [1, 1])
    want = torch.nn.functional.conv2d(
        torch.nn.functional.pad(x.float() - zp, (1, 1, 1, 1)), weight.float()
    )
    args = (pack(flat), zero_point_offset(flat, zp), torch.ones(oc), None, oc, *geometry, zp)
    got = quantree_ops.conv2d(x, *args, 0.0, 0, False)
    assert torch.equal(got.contiguous(), want)
    q = quantree_ops.conv2d(x, *args, 2.0**-10, -7, True)
    expect = torch.clamp(torch.round(want * 2.0**10) - 7, -7, 127).to(torch.int8)
    assert torch.equal(q.contiguous(), expect)


def test_seven_bit_weights_are_exact():
    """Weights within [-63, 63] (``Int8Quantizer(reduce_range=True)``) reach the AVX2 path's
    `vpmaddubsw` GEMM (csrc/isa_avx2_w7.cpp), exact for them: at its largest pair sums
    (weights -63 / 63 on inputs -128 / 127, read as 0 / 255) the conv and the linear give the
    exact integer results."""
    torch.manual_seed(7)
    x = torch.where(torch.rand(1, 40, 27, 27) < 0.5, 127, -128).to(torch.int8)
    w = torch.where(torch.rand(40, 40, 3, 3) < 0.5, 63, -63).to(torch.int8)
    w[::3] = random_int8(*w[::3].shape, low=-63, high=64)
    seven_bit_conv(w, x, -128)  # every padded tap reads 0 after the flip: 255 x 63 pairs
    seven_bit_conv(w, random_int8(2, 40, 27, 27), 5)
    xl, wl = x.reshape(-1, 27)[:37].contiguous(), w.reshape(-1, 9)[:33].repeat(1, 3)
    got = quantree_ops.linear(xl, pack(wl), zero_point_offset(wl, 0), torch.ones(33), None, 33,
                              0.0, 0, False)  # fmt: skip
    assert torch.equal(got, (xl.float() @ wl.float().t()))


@pytest.mark.parametrize("wide", [127, -128, 64])
def test_one_eight_bit_weight_keeps_the_exact_gemm(wide):
    """One weight past [-63, 63] among 63s keeps the whole conv off the 7-bit GEMM: with 127
    beside 63 on inputs of 255, `vpmaddubsw` would saturate (255 x 190 > 2^15) and the
    sums would differ."""
    w = torch.full((40, 40, 3, 3), 63, dtype=torch.int8)
    w[17, 11, 1, 1] = wide
    seven_bit_conv(w, torch.full((1, 40, 27, 27), 127, dtype=torch.int8), -128)


def test_pack_layout():
    w = torch.arange(20 * 6, dtype=torch.int32).reshape(20, 6).remainder(127).to(torch.int8)
    p = pack(w)
    assert p.shape == (2, 2, 64)
    # block 0, k-group 1, channel 3, lane 1 -> w[3, 5]; padding is zero
    assert p[0, 1, 3 * 4 + 1] == w[3, 5] and p[0, 1, 3 * 4 + 2] == 0
    assert p[1, 0, 3 * 4 + 0] == w[19, 0] and p[1, 0, 4 * 4] == 0


def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 7, 10, dtype=torch.int8)
        w = torch.empty(1, 3, 64, dtype=torch.int8)
        out = quantree_ops.linear(x, w, torch.empty(16, dtype=torch.int32),
                                  torch.empty(16), None, 16, 0.1, 0, False)  # fmt: skip
        assert out.shape == (2, 7, 16) and out.dtype == torch.int8
        img = torch.empty(2, 3, 9, 8, dtype=torch.int8)
        geometry = ([3, 3], [2, 1], [1, 0], [1, 1])
        off, scale = torch.empty(5, dtype=torch.int32), torch.empty(5)
        conv = quantree_ops.conv2d(img, w, off, scale, None, 5, *geometry, 0, 0.0, 0, False)
        assert conv.shape == (2, 5, 5, 6) and conv.dtype == torch.float32


def test_builds_a_fresh_cache(tmp_path, monkeypatch):
    """A direct compiler build into an empty cache gives a library with the same kernels,
    and a sidecar that marks it whole."""
    import ctypes

    from quantree.backends.cpu.native import loader as native
    from quantree.backends.cpu.ops import elementwise

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = native.build("quantree_kernels_fresh")
    assert path.parent.parent == tmp_path and native.intact(path)
    dequantize = ctypes.CDLL(str(path)).qt_dequantize
    dequantize.argtypes = elementwise.SIGNATURES["qt_dequantize"]
    x = torch.tensor([-3, 0, 5, 127], dtype=torch.int8)
    out = torch.empty(4, dtype=torch.float32)
    dequantize(native.ptr(x), 4, 0.5, 1.0, native.ptr(out))
    assert out.tolist() == [-2.0, -0.5, 2.0, 63.0]
