"""Shape arithmetic runs once per input shape (``passes/per_shape.py``).

The model pads each convolution as Hugging Face's Encodec does (``_get_extra_padding_for_conv1d``
and ``_pad1d``, reflect mode): 0-d integer buffers, a float ``ceil``, ``item`` and the
``_assert_scalar``s ``torch.export`` writes for the unbacked integers, all on the input's
symbolic length. Lowered with and without the pass, the two models give the same bits at
every length; the kept values follow the shape (and the constants) they were computed from.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend
from quantree.backends.cpu.passes.per_shape import SHAPES_KEPT, PerShape
from quantree.backends.cpu.saved.serialize import load, save

aten = torch.ops.aten
AUTO = torch.export.Dim.AUTO


class PaddedConv(nn.Module):
    """Encodec's causal ``EncodecConv1d``, its geometry in buffers as there."""

    def __init__(self, cin: int, cout: int, k: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, stride)
        self.register_buffer("stride", torch.tensor(stride), persistent=False)
        self.register_buffer("kernel_size", torch.tensor(k), persistent=False)
        self.register_buffer("padding_total", torch.tensor(k - stride), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = (length - self.kernel_size + self.padding_total) / self.stride + 1
        frames = torch.ceil(frames).to(torch.int64) - 1
        extra = frames * self.stride + self.kernel_size - self.padding_total - length
        left, right = self.padding_total, extra
        max_pad = max(left, right)
        extra_pad = 0
        if length <= max_pad:
            extra_pad = max_pad - length + 1
            x = nn.functional.pad(x, (0, extra_pad))
        padded = nn.functional.pad(x, (left, right), "reflect")
        return self.conv(padded[..., : padded.shape[-1] - extra_pad])


class Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = PaddedConv(1, 4, 7, 1)
        self.b = PaddedConv(4, 4, 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def lowered() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    """(with the pass, without it, calibration data), from one reference graph."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 1, 64, generator=g),) for _ in range(4)]
    ref = qt.quantize(
        Codec().eval(), data[0], data, dynamic_shapes=({0: AUTO, 2: AUTO},), progress=False,
        backend="reference",
    )  # fmt: skip
    once = qt.lower(ref, CPU)
    original = cpu_backend.compute_once_per_shape
    cpu_backend.compute_once_per_shape = lambda gm: gm  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.compute_once_per_shape = original
    return once, plain, data


def per_shape(gm: torch.fx.GraphModule) -> PerShape:
    (call,) = [n.target for n in gm.graph.nodes if isinstance(n.target, PerShape)]
    return call


def signal(length: int) -> torch.Tensor:
    return torch.randn(2, 1, length, generator=torch.Generator().manual_seed(length))


def test_shape_arithmetic_becomes_one_call_with_the_same_bits(lowered) -> None:  # type: ignore[no-untyped-def]
    once, plain, _ = lowered
    arithmetic = {aten._assert_scalar.default, aten.item.default, aten.ceil.default}
    assert arithmetic <= {n.target for n in plain.graph.nodes}
    assert not arithmetic & {n.target for n in once.graph.nodes}
    calls = [n for n in once.graph.nodes if n.op == "call_function"]
    assert len(calls) < len([n for n in plain.graph.nodes if n.op == "call_function"]) // 2
    with torch.no_grad():
        for length in (64, 100, 37, 513, 64, 65):  # the captured length and others
            got = once(signal(length))
            assert torch.equal(got, plain(signal(length))), length


def test_values_are_kept_per_shape_and_follow_the_shape(lowered) -> None:  # type: ignore[no-untyped-def]
    """Each new length evaluates once; a length seen before is not evaluated again, and its
    values are its own (a key that ignored the length would pad 90 as 50 was padded: a
    different output length, or different bits)."""
    once, plain, _ = lowered
    call = per_shape(once)
    call.kept.clear()
    before = call.evaluations
    with torch.no_grad():
        for i, length in enumerate((50, 90, 50, 90, 51)):
            got = once(signal(length))
            assert torch.equal(got, plain(signal(length))), length
            assert call.evaluations - before == (1, 2, 2, 2, 3)[i]
        # the batch is part of the shape too
        x = torch.randn(3, 1, 50)
        assert torch.equal(once(x), plain(x))
    assert call.evaluations - before == 4 and len(call.kept) == 4


def test_kept_shapes_are_bounded(lowered) -> None:  # type: ignore[no-untyped-def]
    once, plain, _ = lowered
    call = per_shape(once)
    with torch.no_grad():
        for length in range(40, 40 + SHAPES_KEPT + 5):
            assert torch.equal(once(signal(length)), plain(signal(length)))
    assert len(call.kept) == SHAPES_KEPT


def test_a_shape_violating_an_assert_raises_every_time(lowered) -> None:  # type: ignore[no-untyped-def]
    """Export assumed the short-input branch of ``_pad1d`` is not taken (``length > max
    pad``); a length of 4 takes it: the lowered model refuses it as the plain one does, on
    every call, and keeps nothing for it."""
    once, plain, _ = lowered
    call = per_shape(once)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Runtime assertion failed"):
        plain(signal(4))
    kept = len(call.kept)
    for _ in range(2):
        with torch.no_grad(), pytest.raises(RuntimeError, match="Runtime assertion failed"):
            once(signal(4))
    assert len(call.kept) == kept


def test_a_constant_changed_in_place_is_evaluated_again(lowered) -> None:  # type: ignore[no-untyped-def]
    once, _, _ = lowered
    call = per_shape(once)
    node = next(n for n in once.graph.nodes if n.target is call)
    reads = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    stride = next(a for a in reads if str(a.target).endswith("a.stride"))
    tensor = operator.attrgetter(str(stride.target))(once)
    with torch.no_grad():
        x = signal(70)
        first = once(x)
        before = call.evaluations
        assert torch.equal(once(x), first) and call.evaluations == before
        tensor.fill_(1)  # the same value, written: the version moves
        assert torch.equal(once(x), first) and call.evaluations == before + 1


def test_fake_tensors_run_the_original_nodes(lowered) -> None:  # type: ignore[no-untyped-def]
    """What ``save`` exports: the shape arithmetic itself, not a kept value."""
    once, _, data = lowered
    program = torch.export.export(once, data[0], dynamic_shapes=({0: AUTO, 2: AUTO},), strict=False)
    targets = {n.target for n in program.graph.nodes}
    assert aten._assert_scalar.default in targets and aten.item.default in targets
    assert not any(isinstance(t, PerShape) for t in targets)


def test_saved_model_loads_with_the_call_again(lowered, tmp_path) -> None:  # type: ignore[no-untyped-def]
    once, plain, data = lowered
    save(once, tmp_path / "codec.pt2", data[0])
    loaded = load(tmp_path / "codec.pt2")
    assert isinstance(loaded, torch.fx.GraphModule)
    assert per_shape(loaded) is not per_shape(once)
    with torch.no_grad():
        x = data[0][0]
        assert torch.equal(loaded(x), plain(x))


class Positions(nn.Module):
    """Griffin's attention block in small: position ids, a causal mask and a rotary-style
    table built from the input's symbolic length on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1])
        mask = torch.where(pos[None, :] <= pos[:, None], 0.0, -1e9)
        angle = torch.cos(pos[:, None].float() * 0.1)
        h = self.proj(x) * angle
        return torch.softmax(h @ h.transpose(-1, -2) + mask, -1) @ h


def test_tables_of_a_symbolic_length_are_kept_per_length(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The mask and table follow the length: built once per length (with the same bits as
    built every call), and built every call once they outgrow ``KEPT_ELEMENTS``."""
    from quantree.backends.cpu.passes import per_shape as pass_module

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(1, 24, 8, generator=g),) for _ in range(4)]
    ref = qt.quantize(
        Positions().eval(), data[0], data, dynamic_shapes=({1: AUTO},), progress=False,
        backend="reference",
    )  # fmt: skip
    once = qt.lower(ref, CPU)
    original = cpu_backend.compute_once_per_shape
    cpu_backend.compute_once_per_shape = lambda gm: gm  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.compute_once_per_shape = original
    assert aten.arange.default in {n.target for n in plain.graph.nodes}
    built = {aten.arange.default, aten.where.ScalarOther, aten.cos.default}
    assert not built & {n.target for n in once.graph.nodes}
    call = per_shape(once)
    with torch.no_grad():
        for i, length in enumerate((24, 40, 24, 40)):
            x = torch.randn(1, length, 8, generator=g)
            assert torch.equal(once(x), plain(x)), length
            assert call.evaluations == (1, 2, 2, 2)[i]
        monkeypatch.setattr(pass_module, "KEPT_ELEMENTS", 30 * 30 - 1)
        for i in range(2):  # a 30 x 30 mask: over the bound, built every call
            x = torch.randn(1, 30, 8, generator=g)
            assert torch.equal(once(x), plain(x))
            assert call.evaluations == 3 + i
