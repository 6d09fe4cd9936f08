"""int8 transposed convolutions: the recipe's grids, the native kernel's exact accumulation,
and the lowered model against the reference graph.

The kernel's int32 accumulation is exact, so against a reference whose arithmetic is exact
too (power-of-two scales: every dequantized value, product and partial sum is a float32
integer multiple of one power of two while the sums stay below 2**24 of it) the lowered
model equals the reference bit for bit. The kernel alone is checked against
``sum (x - zp) * w`` computed in float64 (exact here) on random geometries.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.ops.conv_transpose import packed_transposed_weight
from quantree.backends.cpu.ops.wide import split16

from support import batches, run

POW2 = qt.Int8Quantizer(
    activations=qt.ActivationPoints.EVERY_OP,
    activation=qt.QuantSpec(qt.QDtype.INT8, power_of_two=True),
    weight=qt.QuantSpec(
        qt.QDtype.INT8, symmetric=True, axis=0, quant_min=-127, quant_max=127, power_of_two=True
    ),
)
OP = torch.ops.quantree.conv_transpose.default


class Upsampler(nn.Module):
    """A vocoder's shape: transposed conv 1-d stack with leaky relu, then a conv1d."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ConvTranspose1d(12, 8, 8, stride=4, padding=2)
        self.b = nn.ConvTranspose1d(8, 6, 4, stride=2, padding=1, output_padding=1, groups=2)
        self.c = nn.Conv1d(6, 1, 7, padding=3)

    def forward(self, x):
        x = self.a(nn.functional.leaky_relu(x, 0.1))
        x = self.b(nn.functional.leaky_relu(x, 0.1))
        return self.c(x)


class Decoder(nn.Module):
    """A U-Net decoder's shape: transposed conv 2-d (+relu), a dilated and grouped one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ConvTranspose2d(10, 8, 2, stride=2)
        self.b = nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.c = nn.ConvTranspose2d(6, 4, (3, 2), stride=(1, 2), dilation=(2, 1), bias=False)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Wide(nn.Module):
    """More than 512 input channels: the kernel reduces in chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ConvTranspose2d(600, 5, 3, stride=2)

    def forward(self, x):
        return self.a(x)


@pytest.mark.parametrize(
    ("cls", "shape", "count"),
    [(Upsampler, (2, 12, 9), 2), (Decoder, (2, 10, 4, 5), 3), (Wide, (1, 600, 3, 2), 1)],
    ids=["1d", "2d", "chunks"],
)
def test_lowered_equals_reference_exactly(cls, shape, count):
    torch.manual_seed(0)
    model = cls().eval()
    data = batches(shape, n=4)
    _, ref = run(model, data, POW2)
    low = qt.lower(ref, CPU)
    assert sum(n.target == OP for n in low.graph.nodes) == count
    assert not any("conv_transpose" in str(n.target) for n in low.graph.nodes if n.target != OP)
    with torch.no_grad():
        for args in data:
            assert torch.equal(ref(*args), low(*args))


def test_recipe_grids():
    """The weight per channel along axis 1 (one scale per output channel of a group), an
    int32 bias with one scale per output channel, in both activation modes."""
    torch.manual_seed(0)
    model = Decoder().eval()
    data = batches((2, 10, 4, 5), n=2)
    for points in (qt.ActivationPoints.EVERY_OP, qt.ActivationPoints.WEIGHTED_INPUTS):
        _, ref = run(model, data, qt.Int8Quantizer(activations=points))
        per_channel = [
            n
            for n in ref.graph.nodes
            if n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
        ]
        axes = sorted((n.args[3], tuple(n.meta["val"].shape)) for n in per_channel)
        # weights [C, O/groups, k, k] on axis 1; biases [O] (b's: 6 = 3 per group x 2) on 0
        assert (1, (10, 8, 2, 2)) in axes and (1, (8, 3, 3, 3)) in axes
        assert (0, (6,)) in axes and (0, (8,)) in axes
        assert sum(n.target == OP for n in qt.lower(ref, CPU).graph.nodes) == 3


def test_float_output_and_default_recipe_close_to_reference():
    """Default (non power-of-two) scales: a float output differs from the reference only by
    the reference's float rounding (the sums here stay far below 2**24 units: relative 1e-5)."""
    torch.manual_seed(1)
    model = Upsampler().eval()
    data = batches((2, 12, 9), n=3)
    _, ref = run(model, data)
    low = qt.lower(ref, CPU)
    assert sum(n.target == OP for n in low.graph.nodes) == 2
    with torch.no_grad():
        for args in data:
            want, got = ref(*args), low(*args)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _reference(x, w, zp, stride, padding, output_padding, dilation, groups):
    """sum (x - zp) * w in float64: exact for these sizes."""
    fn = nn.functional.conv_transpose1d if x.dim() == 3 else nn.functional.conv_transpose2d
    return fn(x.double() - zp, w.double(), None, stride, padding, output_padding, groups, dilation)


@settings(max_examples=60, deadline=None)
@given(
    dims=st.sampled_from([1, 2]),
    groups=st.integers(1, 3),
    cin=st.integers(1, 6),
    cout=st.integers(1, 20),
    kernel=st.integers(1, 4),
    stride=st.integers(1, 4),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 3),
    extra=st.integers(0, 3),
    size=st.integers(1, 7),
    zp=st.integers(-128, 127),
    quantized=st.booleans(),
    layout=st.sampled_from(["contiguous", "channels_last"]),
    seed=st.integers(0, 2**16),
)
def test_kernel_exact_on_random_geometry(
    dims, groups, cin, cout, kernel, stride, padding, dilation, extra, size, zp, quantized,
    layout, seed,
):  # fmt: skip
    """Float output with scale 1 is the exact integer sum; int8 output is its quantization
    (round half to even of acc * scale + bias, then the zero point)."""
    g = torch.Generator().manual_seed(seed)
    output_padding = extra % max(stride, dilation)
    assume((size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding >= 0)
    shape = (2, cin * groups, *([size] * dims))
    x = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    if layout == "channels_last":
        x = x.transpose(1, -1).contiguous().transpose(1, -1)
    w = torch.randint(-127, 128, (cin * groups, cout, *([kernel] * dims)), dtype=torch.int8,
                      generator=g)  # fmt: skip
    geometry = ([kernel] * dims, [stride] * dims, [padding] * dims, [output_padding] * dims,
                [dilation] * dims)  # fmt: skip
    want = _reference(x, w, zp, stride, padding, output_padding, dilation, groups)
    packed, col_offset = packed_transposed_weight(w, groups, zp)
    n = cout * groups
    offset = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g)
    ones = torch.ones(n)
    exact = OP(x, packed, col_offset, offset, ones, None, n, *geometry, groups, 0.0, 0, False)
    expected = want + offset.double().reshape(1, n, *([1] * dims))
    assert torch.equal(exact.double(), expected)
    if quantized:
        scale, bias = torch.full((n,), 2.0**-10), torch.randn(n, generator=g)
        got = OP(x, packed, col_offset, offset, scale, bias, n, *geometry, groups, 0.5, 3, True)
        view = (1, n, *([1] * dims))
        y = expected.float() * (scale * 2.0).reshape(view) + (bias * 2.0).reshape(view)
        q = (torch.round(y) + 3).clamp(3, 127).to(torch.int8)
        assert torch.equal(got, q)


OP16 = torch.ops.quantree.conv_transpose16.default


def _two_int8_calls(x, x_scale, w, hi_col, lo_col, offset, hi_scale, scale, bias, n, geometry,
                    groups):  # fmt: skip
    """The int16 input as its two int8 planes, each through the int8 kernel (whose sums the
    test above checks), the float results added: what conv_transpose16 computes."""
    hi, lo = split16(x, x_scale, -32768, 32767)
    zeros = torch.zeros(n, dtype=torch.int32)
    y = OP(hi, w, hi_col, zeros, hi_scale, None, n, *geometry, groups, 0.0, 0, False)
    y += OP(lo, w, lo_col, offset, scale, bias, n, *geometry, groups, 0.0, 0, False)
    return y


@settings(max_examples=60, deadline=None)
@given(
    dims=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    cin=st.integers(1, 9),
    cout=st.integers(1, 5),
    kernel=st.integers(1, 8),
    stride=st.integers(1, 4),
    padding=st.integers(0, 3),
    dilation=st.integers(1, 2),
    extra=st.integers(0, 3),
    size=st.integers(1, 12),
    layout=st.sampled_from(["contiguous", "channels_last", "sliced"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int16_input_equals_its_two_planes(
    dims, groups, cin, cout, kernel, stride, padding, dilation, extra, size, layout, bias, seed
):  # fmt: skip
    """conv_transpose16 quantizes and splits its float input inside and sums both planes in
    one call: equal bit for bit to the two int8 calls on the planes, on every layout (read
    through its strides) and with inputs beyond the int16 range (clamped)."""
    g = torch.Generator().manual_seed(seed)
    output_padding = extra % max(stride, dilation)
    padding = min(padding, dilation * (kernel - 1))
    assume((size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding >= 0)
    c, n = cin * groups, cout * groups
    shape = (2, 2 * c if layout == "sliced" else c, *([size] * dims))
    x = torch.randn(shape, generator=g) * 4
    if layout == "channels_last":
        x = x.transpose(1, -1).contiguous().transpose(1, -1)
    elif layout == "sliced":
        x = x[:, ::2]
    w = torch.randint(-127, 128, (c, cout, *([kernel] * dims)), dtype=torch.int8, generator=g)
    packed, hi_col = packed_transposed_weight(w, groups, 0)
    _, lo_col = packed_transposed_weight(w, groups, -128)
    offset = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g)
    scale = torch.rand(n, generator=g) * 1e-3
    b = torch.randn(n, generator=g) if bias else None
    geometry = ([kernel] * dims, [stride] * dims, [padding] * dims, [output_padding] * dims,
                [dilation] * dims)  # fmt: skip
    args = (3.0 / 32767, packed, hi_col, lo_col, offset, scale * 256, scale, b, n)
    want = _two_int8_calls(x, *args, geometry, groups)
    got = OP16(x, args[0], -32768, 32767, *args[1:], *geometry, groups)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)


def test_int16_input_over_chunks_equals_its_two_planes():
    """More than 512 input channels a group: both planes reduce chunk by chunk."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 600, 3, 2, generator=g)
    w = torch.randint(-127, 128, (600, 5, 3, 3), dtype=torch.int8, generator=g)
    packed, hi_col = packed_transposed_weight(w, 1, 0)
    _, lo_col = packed_transposed_weight(w, 1, -128)
    scale = torch.rand(5, generator=g) * 1e-4
    args = (1e-4, packed, hi_col, lo_col, torch.arange(5, dtype=torch.int32), scale * 256,
            scale, torch.randn(5, generator=g), 5)  # fmt: skip
    geometry = ([3, 3], [2, 2], [0, 0], [1, 0], [1, 1])
    want = _two_int8_calls(x, *args, geometry, 1)
    assert torch.equal(OP16(x, args[0], -32768, 32767, *args[1:], *geometry, 1), want)


def test_bad_arguments_refused():
    x = torch.zeros(1, 4, 5, dtype=torch.int8)
    w = torch.zeros(4, 3, 2, dtype=torch.int8)
    packed, col_offset = packed_transposed_weight(w, 1, 0)
    constants = (torch.zeros(3, dtype=torch.int32), torch.ones(3), None)
    good = ([2], [2], [0], [0], [1], 1, 0.0, 0, False)
    OP(x, packed, col_offset, *constants, 3, *good)  # runs
    with pytest.raises(NativeArgumentError, match="weight"):
        OP(x, packed[:-1], col_offset, *constants, 3, *good)
    with pytest.raises(NativeArgumentError, match=r"x is torch\.float32"):
        OP(x.float(), packed, col_offset, *constants, 3, *good)
    with pytest.raises(NativeArgumentError, match="output_padding"):
        OP(x, packed, col_offset, *constants, 3, [2], [2], [0], [2], [1], 1, 0.0, 0, False)
    with pytest.raises(NativeArgumentError, match="col_offset"):
        OP(x, packed, col_offset[:2], *constants, 3, *good)
    with pytest.raises(NativeArgumentError, match="groups"):
        OP(x, packed, col_offset, *constants, 3, [2], [2], [0], [0], [1], 3, 0.0, 0, False)


class Parallel1d(nn.Module):
    """Two 1-d transposed convs reading the input (one grouped, dilated), summed in float."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ConvTranspose1d(12, 8, 8, stride=4, padding=2)
        self.b = nn.ConvTranspose1d(12, 8, 3, stride=4, padding=1, output_padding=1, dilation=2,
                                    groups=2)  # fmt: skip

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize(
    ("cls", "shape", "wide", "narrow"),
    [(Parallel1d, (2, 12, 9), 2, 0), (Decoder, (2, 10, 4, 5), 0, 3)],
    ids=["1d_int16", "2d_int8"],
)
def test_weighted_inputs_reads_like_the_convolutions(cls, shape, wide, narrow):
    """Under WEIGHTED_INPUTS a 1-d transposed conv reads int16 (two int8 planes, each an
    exact int32 sum, joined in float), a 2-d one int8, as conv1d / conv2d do. The float
    results are within the reference's float rounding: 1e-5 of the output's largest value
    (the int16 sums exceed float32's 24 bits, so the reference rounds them). The layers
    end the models: a quantized point after them could round one code apart."""
    torch.manual_seed(0)
    data = batches(shape, n=3)
    quantizer = qt.Int8Quantizer(activations=qt.ActivationPoints.WEIGHTED_INPUTS)
    _, ref = run(cls().eval(), data, quantizer)
    low = qt.lower(ref, CPU)
    targets = [n.target for n in low.graph.nodes]
    assert targets.count(torch.ops.quantree.conv_transpose16.default) == wide
    assert targets.count(OP) == narrow
    with torch.no_grad():
        for args in data:
            want, got = ref(*args), low(*args)
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_saved_and_loaded_model_computes_the_same(tmp_path):
    """The ops survive ``torch.export`` save/load (fake kernels, constants): int8 and int16
    inputs alike."""
    from quantree.backends import load, save

    torch.manual_seed(0)
    for i, (cls, shape, points) in enumerate(
        [
            (Decoder, (2, 10, 4, 5), qt.ActivationPoints.EVERY_OP),
            (Parallel1d, (2, 12, 9), qt.ActivationPoints.WEIGHTED_INPUTS),
        ]
    ):
        data = batches(shape, n=2)
        _, ref = run(cls().eval(), data, qt.Int8Quantizer(activations=points))
        low = qt.lower(ref, CPU)
        path = tmp_path / f"m{i}.pt2"
        save(low, path, data[0])
        loaded = load(path)
        with torch.no_grad():
            assert torch.equal(loaded(*data[1]), low(*data[1]))
