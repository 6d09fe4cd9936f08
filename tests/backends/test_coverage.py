"""The CPU backend lowers what the default quantizer quantizes in common models.

For each op: a small model, ``ref = convert(...)``, ``low = lower(ref, CPU)``; the float op
is gone from ``low.graph`` (a native ``quantree.*`` op does its work) and every output
matches the reference at >= 35 dB SQNR. Where the int8 arithmetic is exact (convolutions
with power-of-two scales; the elementwise ops and tables, which use the reference's own
float steps) the lowered model equals the reference bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

import pytest
import torch
import torch.nn.functional as F
from test_exact import POW2
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.core.graphs import fetch_attr
from quantree.core.lower import Backend

from support import batches, leaves, run

THRESHOLD_DB = 35.0
EXACTNESS = pytest.mark.parametrize(
    ("quantizer", "exact"), [(None, False), (POW2, True)], ids=["int8", "pow2"]
)
"""The default quantizer (>= 35 dB), and power-of-two scales (bit-equal: exact int32 math)."""
aten = torch.ops.aten
native = torch.ops.quantree


def lowered(
    model: nn.Module,
    shape: tuple[int, ...],
    quantizer: qt.Quantizer | None = None,
    backend: Backend = CPU,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list[tuple[torch.Tensor, ...]]]:
    """(reference, lowered, data) for ``model`` on random batches of ``shape``."""
    torch.manual_seed(0)
    data = batches(shape, n=6)
    _, ref = run(model.eval(), data, quantizer)
    return ref, qt.lower(ref, backend), data


def targets(gm: torch.fx.GraphModule) -> set[object]:
    """The ops ``gm`` calls, those a region program runs (its instructions) included."""
    found = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    ops = ("quantize", "dequantize", "linear", "binary", "lookup")  # codes 0-4, qt_program.h
    by_code = {i: getattr(native, name).default for i, name in enumerate(ops)}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == native.program.default:
            code = fetch_attr(gm, str(n.args[2].target))
            found |= {by_code[op] for op in code[:, 0].tolist() if op in by_code}
    return found


def assert_matches(ref, low, data, exact: bool) -> None:
    with torch.no_grad():
        for args in data:
            want, got = leaves(ref(*args)), leaves(low(*args))
            assert len(want) == len(got)
            for w, g in zip(want, got, strict=True):
                assert w.shape == g.shape
                assert qt.sqnr(w, g) >= THRESHOLD_DB
                if exact:
                    assert torch.equal(w, g)


def check(
    model: nn.Module,
    shape: tuple[int, ...],
    gone: AbstractSet[object],
    present: AbstractSet[object],
    exact: bool = False,
    quantizer: qt.Quantizer | None = None,
) -> torch.fx.GraphModule:
    ref, low, data = lowered(model, shape, quantizer)
    assert gone <= targets(ref), "the reference should hold the float ops"
    assert not gone & targets(low)
    assert present <= targets(low)
    assert_matches(ref, low, data, exact)
    return low


# --- conv1d: the conv2d kernel on [N, C, 1, L] --------------------------------------------


class Conv1dStack(nn.Module):
    """bias + fused relu, no bias with stride and dilation, 'same' with an even kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(5, 24, 3, padding=1)
        self.b = nn.Conv1d(24, 20, 4, stride=2, dilation=2, padding=3, bias=False)
        self.c = nn.Conv1d(20, 16, 4, padding="same")
        self.d = nn.Conv1d(16, 8, 3, padding="valid")

    def forward(self, x):
        return self.d(self.c(self.b(torch.relu(self.a(x)))))


CONV1D = ({aten.conv1d.default, aten.conv1d.padding, aten.relu.default}, {native.conv1d.default})


@EXACTNESS
def test_conv1d(quantizer, exact):
    low = check(Conv1dStack(), (3, 5, 40), *CONV1D, exact=exact, quantizer=quantizer)
    convs = [n for n in low.graph.nodes if n.target == native.conv1d.default]
    assert len(convs) == 4 and sum(bool(n.args[-2]) for n in convs) == 1  # one fused relu


def test_conv1d_save_load_round_trip(tmp_path):
    _, low, data = lowered(Conv1dStack(), (3, 5, 40))
    save(low, tmp_path / "conv1d.pt2", data[0])
    loaded = load(tmp_path / "conv1d.pt2")
    assert native.conv1d.default in targets(loaded)  # type: ignore[arg-type]
    with torch.no_grad():
        for args in data[:3]:
            assert torch.equal(loaded(*args), low(*args))


# --- conv2d: padding strings, groups ----------------------------------------------------


class Conv2dPadding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding="same")
        self.b = nn.Conv2d(16, 16, (2, 4), padding="same", dilation=(1, 2))  # asymmetric
        self.c = nn.Conv2d(16, 8, 3, padding="valid", bias=False)

    def forward(self, x):
        return self.c(self.b(F.relu(self.a(x))))


@EXACTNESS
def test_conv2d_padding_strings(quantizer, exact):
    gone = {aten.conv2d.padding, aten.relu.default}
    check(Conv2dPadding(), (2, 3, 9, 8), gone, {native.conv2d.default}, exact, quantizer)


class Grouped(nn.Module):
    """A grouped conv (32 channels a group), a depthwise one, a depthwise conv1d."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv2d(64, 64, 3, padding=1, groups=2)
        self.depthwise = nn.Conv2d(64, 64, 3, stride=2, padding=1, groups=64)
        self.pointwise = nn.Conv1d(64, 24, 1)
        self.depthwise1d = nn.Conv1d(24, 24, 5, padding=2, groups=24, bias=False)

    def forward(self, x):
        y = self.depthwise(F.relu(self.grouped(x)))
        return self.depthwise1d(self.pointwise(y.flatten(2)))


@EXACTNESS
def test_grouped_and_depthwise(quantizer, exact):
    gone = {aten.conv2d.default, aten.conv1d.default}
    present = {native.conv2d.default, native.conv1d.default}
    low = check(Grouped(), (2, 64, 9, 10), gone, present, exact, quantizer)
    convs = (n for n in low.graph.nodes if str(n.target).startswith("quantree.conv"))
    groups = sorted(n.args[-1] for n in convs)
    assert groups == [1, 2, 24, 64]


# --- in-place ops and relu6 ---------------------------------------------------------------


class Residual(nn.Module):
    """ResNet's ``out += identity`` and in-place activations, sub_ and mul_."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.relu6 = nn.ReLU6(inplace=True)

    def forward(self, x):
        identity = self.a(x)
        out = self.b(identity)
        out += identity
        out = self.relu(out)
        other = self.b(x)
        other -= identity
        other *= out
        return self.relu6(other), F.hardtanh(out, -1.0, 2.0)


def test_in_place_residual():
    gone = {
        aten.add_.Tensor,
        aten.sub_.Tensor,
        aten.mul_.Tensor,
        aten.relu_.default,
        aten.hardtanh_.default,
        aten.hardtanh.default,
    }
    low = check(Residual(), (2, 8, 6, 7), gone, {native.binary.default, native.lookup.default})
    kinds = sorted(n.args[0] for n in low.graph.nodes if n.target == native.binary.default)
    assert kinds == ["add", "mul", "sub"]


class Activations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        return F.relu6(y), torch.clamp(y, -0.5, 0.5), F.silu(self.a(x), inplace=True)


def test_relu6_clamp_and_in_place_activation():
    gone = {aten.relu6.default, aten.clamp.default, aten.silu_.default}
    check(Activations(), (4, 16), gone, {native.lookup.default}, exact=True)


class WriteSeenTwice(nn.Module):
    """``y.add_(z)`` where the dequantized ``y`` is also read by a float op (erf)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        y, z = self.a(x), self.b(x)
        e = torch.erf(y)  # no rule: stays float, reads the same dequantized y
        y.add_(z)
        return y, e


def test_in_place_write_others_read_is_kept():
    """The in-place op stays (its write could be observed) and the result is still right."""
    with pytest.warns(qt.QuantreeWarning, match="erf"):
        ref, low, data = lowered(WriteSeenTwice(), (4, 16))
    written = next(n for n in ref.graph.nodes if n.target == aten.add_.Tensor).args[0]
    assert len(written.users) > 1 and aten.add_.Tensor in targets(low)
    assert_matches(ref, low, data, exact=True)


# --- softmax --------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) * 0.2
        return torch.matmul(torch.softmax(scores, -1), self.v(x)), torch.softmax(scores, 1)


SOFTMAX_CPU = CPU  # softmax is one of its rules


def test_softmax_last_dim():
    every_op = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)
    ref, low, data = lowered(Attention(), (2, 9, 32), every_op, backend=SOFTMAX_CPU)
    softmaxes = [n for n in low.graph.nodes if n.target == aten.softmax.int]
    assert [n.args[1] for n in softmaxes] == [1]  # the last-dim one is native
    assert native.softmax.default in targets(low)
    assert_matches(ref, low, data, exact=False)


def test_softmax_within_one_step():
    """Exponentials from a table, a different summation order: rarely one step off."""
    ref, low, data = lowered(nn.Sequential(nn.Linear(64, 64), nn.Softmax(-1)), (32, 64),
                             backend=SOFTMAX_CPU)  # fmt: skip
    (out,) = next(n for n in ref.graph.nodes if n.op == "output").args[0]
    scale = float(out.args[1])
    with torch.no_grad():
        for args in data:
            steps = (ref(*args) - low(*args)).abs() / scale
            assert steps.max() < 1.5 and (steps > 0.5).float().mean() < 0.005


# --- layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "keeps_layout"),
    [
        (lambda: torch.randint(-128, 127, (2, 8, 5, 3), dtype=torch.int8).to(
            memory_format=torch.channels_last), True),
        (lambda: torch.randint(-128, 127, (2, 7, 8), dtype=torch.int8).transpose(1, 2), True),
        (lambda: torch.randint(-128, 127, (4, 6), dtype=torch.int8)[:, ::2], False),
    ],
    ids=["channels_last", "transposed", "strided"],
)  # fmt: skip
def test_elementwise_ops_keep_dense_layouts(make: Callable[[], torch.Tensor], keeps_layout):
    """add and table lookups run in memory order on dense operands of one layout (conv
    outputs are channels-last) and write that layout; others are made contiguous."""
    torch.manual_seed(0)
    a, b = make(), make()
    table = torch.arange(-128, 128, dtype=torch.int8).flip(0)  # x -> -1 - x
    out, looked_up = native.binary("add", a, b, 0.1, 3, 0.2, -5, 0.25, 1), native.lookup(a, table)
    dq_a, dq_b = (a.float() - 3) * 0.1, (b.float() + 5) * 0.2
    expect = torch.clamp(torch.round((dq_a + dq_b) * 4.0) + 1, -128, 127).to(torch.int8)
    assert torch.equal(out, expect) and torch.equal(looked_up, -1 - a)
    if keeps_layout:
        assert out.stride() == a.stride() and looked_up.stride() == a.stride()
    else:
        assert out.is_contiguous() and looked_up.is_contiguous()


# --- max pooling -----------------------------------------------------------------------------

POOLS = {
    "lenet": (lambda: nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 10)), (2, 3, 32, 32)),
    "padded-ceil": (lambda: nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)), (1, 3, 31, 31)),
    "dilated": (lambda: nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, dilation=2)), (1, 3, 17, 17)),
}  # fmt: skip


@pytest.mark.parametrize(("factory", "shape"), POOLS.values(), ids=POOLS.keys())
def test_max_pool_after_conv_is_native(factory, shape):
    """ATen has no channels-last int8 max pooling: the native one pools the conv's output."""
    ref, low, data = lowered(factory(), shape)
    assert native.max_pool2d.default in targets(low)
    assert aten.max_pool2d.default not in targets(low)
    assert_matches(ref, low, data, exact=False)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "ceil_mode"),
    [([2, 2], [2, 2], [0, 0], [1, 1], False), ([3, 3], [2, 2], [1, 1], [1, 1], True),
     ([3, 2], [1, 2], [1, 0], [2, 1], False)],
)  # fmt: skip
def test_native_max_pool_equals_aten(kernel, stride, padding, dilation, ceil_mode):
    torch.manual_seed(0)
    x = torch.randint(-128, 128, (2, 19, 13, 11), dtype=torch.int8)
    want = F.max_pool2d(x.float(), kernel, stride, padding, dilation, ceil_mode).to(torch.int8)
    got = native.max_pool2d(
        x.contiguous(memory_format=torch.channels_last), kernel, stride, padding, dilation,
        ceil_mode,
    )  # fmt: skip
    assert torch.equal(want, got)
