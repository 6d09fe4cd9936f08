"""int16 inputs to linear/conv (w8a16) on the CPU backend: two int8 byte planes, exact integers.

The planes must recombine to the reference's int16 quantize bit for bit; a lowered layer
then differs from the reference graph only by float rounding of its epilogues (a lone
layer asserted within 1e-5 of the output's largest value). In a chain that rounding can
move a value the next layer reads across an int16 rounding boundary, one step of 1/32767
of that range: chains are asserted within 1e-4 (measured 1.6e-5 at most). Nothing is left
simulated; programs run the layer as one instruction; saving keeps the outputs exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.ops.wide import split16
from quantree.tools.inspection import INT16_KERNEL, op_statuses

from support import batches, calls, qd

WIDE = qt.Int8Quantizer(activations=qt.ActivationPoints.WEIGHTED_INPUTS)
WIDE_IMAGES = qt.Int8Quantizer(
    activations=qt.ActivationPoints.WEIGHTED_INPUTS,
    activation=qt.QuantSpec(qt.QDtype.INT16, symmetric=True),
    conv1d_weight_dtype=qt.QDtype.INT8,  # int8 weights: the int16-input kernels (conv16)
)  # 2-d convolutions read int16 too (the default keeps them int8)
REL = 1e-5
CHAIN_REL = 1e-4


def _lower_quietly(ref: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        low = qt.lower(ref, CPU)
    return low, [str(w.message) for w in caught]


def _assert_close(
    ref: torch.fx.GraphModule, low: torch.fx.GraphModule, data, rel: float = CHAIN_REL
) -> None:
    with torch.no_grad():
        for args in data:
            want, got = ref(*args), low(*args)
            for w, g in zip(torch.utils._pytree.tree_leaves(want),
                            torch.utils._pytree.tree_leaves(got), strict=True):  # fmt: skip
                assert (w - g).abs().max() <= rel * w.abs().max()


@pytest.mark.parametrize("qmin", [-32768, -32767])
def test_planes_recombine_to_the_reference_quantize(qmin: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 33, generator=g) * 3
    x[0, :4] = torch.tensor([1e9, -1e9, 0.0, -0.0])  # clamped both ends, and zeros
    scale = float(x[1:].abs().max()) / 32767
    want = qd.quantize_per_tensor(x, scale, 0, qmin, 32767, torch.int16).to(torch.int32)
    hi, lo = split16(x, scale, qmin, 32767)
    assert torch.equal(256 * hi.to(torch.int32) + lo.to(torch.int32) + 128, want)


def test_channels_last_planes_keep_the_layout() -> None:
    x = torch.randn(2, 5, 4, 6).contiguous(memory_format=torch.channels_last)
    hi, lo = split16(x, 1e-3, -32768, 32767)
    assert hi.is_contiguous(memory_format=torch.channels_last)
    want = qd.quantize_per_tensor(x, 1e-3, 0, -32768, 32767, torch.int16).to(torch.int32)
    assert torch.equal(256 * hi.to(torch.int32) + lo.to(torch.int32) + 128, want)


class Convs(nn.Module):
    """Every convolution form behind a layer norm (so only what weights read is quantized)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.up = nn.Linear(12, 16)
        self.depthwise = nn.Conv1d(16, 16, 5, padding=2, groups=16)
        self.pointwise = nn.Conv1d(16, 24, 1)
        self.grouped = nn.Conv1d(24, 32, 3, padding="same", groups=2, bias=False)
        self.image = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.image_dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)

    def forward(self, x: torch.Tensor, img: torch.Tensor):
        h = self.up(self.norm(x)).transpose(1, 2)
        h = self.grouped(torch.relu(self.pointwise(nn.functional.silu(self.depthwise(h)))))
        return h, self.image_dw(torch.relu(self.image(img)))


def test_every_conv_form_and_linear_lower_natively_close_to_the_reference() -> None:
    torch.manual_seed(0)
    data = batches((2, 20, 12), (2, 3, 10, 10), n=6)
    ref = qt.quantize(
        Convs().eval(), data[0], data, quantizer=WIDE_IMAGES, progress=False, backend="reference"
    )
    int16 = [n for n in calls(ref, qd.quantize_per_tensor.default) if n.args[-1] == torch.int16]
    assert len(int16) == 6  # every weighted layer's input
    low, notes = _lower_quietly(ref)
    assert not any("simulated" in n for n in notes), notes
    assert len(calls(low, torch.ops.quantree.conv16.default)) == 5
    assert len(calls(low, torch.ops.quantree.linear16.default)) == 1
    assert not calls(low, qd.quantize_per_tensor.default)
    statuses = {o.op: o.status for o in op_statuses(low) if "16" in o.op}
    assert set(statuses.values()) == {INT16_KERNEL}  # inspect says what they read
    _assert_close(ref, low, data)


@pytest.mark.parametrize(
    ("rows", "features"), [(1, 40), (3, 40), (37, 40), (3, 600), (37, 600)]
)  # GEMV and GEMM tiles; over 512 the AVX2 path takes the two planes instead of joining them
def test_a_lone_linear_matches_the_reference(rows: int, features: int) -> None:
    """A lone linear: the kernel's integers are the reference's, so only the epilogue's float
    rounding differs from the reference's float product."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(features), nn.Linear(features, 24)).eval()
    data = batches((rows, features), n=4)
    ref = qt.quantize(model, data[0], data, quantizer=WIDE, progress=False, backend="reference")
    low, _ = _lower_quietly(ref)
    (q16,) = [n for n in calls(ref, qd.quantize_per_tensor.default) if n.args[-1] == torch.int16]
    x = model[0](data[1][0])
    q = qd.quantize_per_tensor(x, q16.args[1], 0, q16.args[3], q16.args[4], torch.int16)
    with torch.no_grad():
        want = ref(*data[1]).double()
        got = low(*data[1]).double()
    assert q.abs().max() > 256  # the high plane carries most of the value
    assert (got - want).abs().max() <= REL * want.abs().max()


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def test_programs_run_int16_linears_as_one_instruction_and_save(tmp_path) -> None:
    torch.manual_seed(0)
    data = batches((1, 12, 32), n=6)
    ref = qt.quantize(Encoder().eval(), data[0], data, progress=False, backend="reference")
    low, notes = _lower_quietly(ref)
    assert not any("simulated" in n for n in notes), notes
    programs = [n for n in low.graph.nodes if "program" in str(n.target)]
    assert programs
    outside = calls(low, torch.ops.quantree.linear16.default)
    assert len(outside) < 8  # 8 linears: the rest run inside programs
    _assert_close(ref, low, data)
    save(low, tmp_path / "m.pt2", data[0])
    loaded = load(tmp_path / "m.pt2")
    with torch.no_grad():
        for args in data[:3]:
            assert torch.equal(loaded(*args), low(*args))


def test_a_programs_int16_linear_reads_only_whole_constants() -> None:
    """LINEAR16 instructions are checked like LINEAR ones: a weight constant shorter than
    N x Kp is refused before the native call (the checker's verdict, not a signal)."""
    from quantree.backends.cpu.native.checks import NativeArgumentError
    from quantree.backends.cpu.native.program_checks import LINEAR16

    torch.manual_seed(0)
    data = batches((1, 12, 32), n=4)
    low, _ = _lower_quietly(
        qt.quantize(Encoder().eval(), data[0], data, progress=False, backend="reference")
    )
    calls_seen: list[tuple] = []

    class Record(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):  # type: ignore[no-untyped-def]
            if "quantree.program" in str(target):
                calls_seen.append(args)
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        Record(low).run(*data[0])
    for args in calls_seen:
        code = args[2]
        wide = [row for row in code.tolist() if row[0] == LINEAR16]
        if wide:
            consts = list(args[1])
            consts[wide[0][3]] = consts[wide[0][3]].reshape(-1)[:16]
            with pytest.raises(NativeArgumentError, match="constant"):
                torch.ops.quantree.program.default(args[0], consts, *args[2:])
            return
    pytest.fail("no region program holds an int16 linear")
