"""A lowered layer's constants are checked once per node (``bound_calls.py``); every way of
changing one afterwards is either run as the fully checked op would run it, or refused with
``NativeArgumentError`` before the kernel (never read out of bounds)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.bound_calls import Binding, BoundLinear, BoundMaxPool2d
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.direct import BoundCall, DirectCall
from quantree.backends.cpu.native.packing import pack

EVERY_OP = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)


class Layers(nn.Module):
    """A grouped, a depthwise and a plain 2-d convolution, a 1-d one and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 16, 3, stride=2, groups=2)
        self.conv1d = nn.Conv1d(16, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 9, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        y = torch.relu(self.depthwise(y))
        y = self.grouped(y).flatten(2)
        return self.fc(torch.relu(self.conv1d(y)).flatten(1))


@pytest.fixture(scope="module")
def lowered() -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    data = [(x + 0.1 * i,) for i in range(3)]
    low = qt.quantize(Layers().eval(), (x,), data, quantizer=EVERY_OP, backend=CPU,
                      progress=False)  # fmt: skip
    return low, x


def _fresh(lowered) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, torch.Tensor]:
    """A copy of the lowered model (bound calls) and one whose nodes call the ops through
    the dispatcher (each call fully checked): the reference a bound call must equal."""
    low, x = lowered
    bound = copy.deepcopy(low)
    checked = copy.deepcopy(low)
    for node in checked.graph.nodes:
        if isinstance(node.target, DirectCall):
            node.target = node.target.op
    checked.recompile()
    return bound, checked, x


def _weights(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The weight buffer of each bound op, by the op's name."""
    names = {}
    for node in gm.graph.nodes:
        if isinstance(node.target, BoundCall):
            name = node.target.op.__name__.split(".")[0]
            names.setdefault(name, node.args[1].target)
    return names


def test_the_layers_are_bound_and_bit_equal_to_the_checked_ops(lowered) -> None:
    bound, checked, x = _fresh(lowered)
    targets = [n.target for n in bound.graph.nodes if isinstance(n.target, BoundCall)]
    assert {t.op.__name__ for t in targets} == {"conv2d.default", "conv1d.default",
                                                "linear.default"}  # fmt: skip
    assert len({id(t.binding) for t in targets}) == len(targets) >= 4  # one per node
    with torch.no_grad():
        first = bound(x)
        assert all(t.binding.bound for t in targets)
        assert torch.equal(first, checked(x))
        assert torch.equal(bound(x), first)


@pytest.mark.parametrize("how", ["copy_", "load_state_dict", ".data =", "setattr"])
def test_a_legit_new_constant_of_the_same_shape_gives_the_new_result(lowered, how) -> None:
    bound, checked, x = _fresh(lowered)
    with torch.no_grad():
        before = bound(x)
        for name in _weights(bound).values():
            old = getattr(bound, name)
            new = torch.randint_like(old, -100, 100)
            if how == "copy_":
                old.copy_(new)
            elif how == "load_state_dict":
                bound.load_state_dict({**bound.state_dict(), name: new})
            elif how == ".data =":
                old.data = new
            else:
                setattr(bound, name, new)
        checked.load_state_dict(bound.state_dict())
        after = bound(x)
        assert not torch.equal(after, before)
        assert torch.equal(after, checked(x))


def _smaller(t: torch.Tensor) -> torch.Tensor:
    """Half of ``t``'s values, flat: too few for the kernel, whatever the layout."""
    return t.reshape(-1)[: t.numel() // 2].clone()


REPLACE = {
    "resize_": lambda gm, name: getattr(gm, name).resize_(_smaller(getattr(gm, name)).shape),
    "set_": lambda gm, name: getattr(gm, name).set_(_smaller(getattr(gm, name))),
    ".data =": lambda gm, name: setattr(getattr(gm, name), "data", _smaller(getattr(gm, name))),
    "setattr": lambda gm, name: setattr(gm, name, _smaller(getattr(gm, name))),
    "swap_tensors": lambda gm, name: torch.utils.swap_tensors(
        getattr(gm, name), _smaller(getattr(gm, name))
    ),
    "load_state_dict(assign)": lambda gm, name: gm.load_state_dict(
        {**gm.state_dict(), name: getattr(gm, name).float()}, assign=True
    ),
}


@pytest.mark.parametrize("how", REPLACE)
@pytest.mark.parametrize("op", ["conv2d", "conv1d", "linear"])
def test_a_constant_replaced_after_binding_is_refused(lowered, op, how) -> None:
    bound, _, x = _fresh(lowered)
    with torch.no_grad():
        bound(x)  # binds
        name = _weights(bound)[op]
        REPLACE[how](bound, name)
        # a conv1d runs as a conv2d, whose contract names itself
        with pytest.raises(NativeArgumentError, match=rf"quantree\.{op[:4]}.*: weight"):
            bound(x)


def test_load_state_dict_of_a_wrong_size_is_torch_s_error_and_changes_nothing(lowered) -> None:
    bound, _, x = _fresh(lowered)
    with torch.no_grad():
        before = bound(x)
        name = _weights(bound)["linear"]
        with pytest.raises(RuntimeError, match="size mismatch"):
            bound.load_state_dict({**bound.state_dict(), name: _smaller(getattr(bound, name))})
        assert torch.equal(bound(x), before)


def test_a_shrunk_constant_restored_runs_again(lowered) -> None:
    """A refusal binds nothing: the next call checks again, and runs once the weight is
    whole (``resize_`` back keeps the storage's bytes)."""
    bound, _, x = _fresh(lowered)
    with torch.no_grad():
        before = bound(x)
        weight = getattr(bound, _weights(bound)["conv2d"])
        shape = weight.shape
        weight.resize_(_smaller(weight).shape)
        with pytest.raises(NativeArgumentError):
            bound(x)
        weight.resize_(shape)
        assert torch.equal(bound(x), before)


def test_an_activation_outside_the_bound_key_is_checked_again() -> None:
    """Another dtype or channel count than the binding's misses it: the full contract runs
    (and refuses what the kernel cannot read)."""
    op = torch.ops.quantree.linear.default
    call = BoundCall(op, op, None, BoundLinear)
    weight = pack(torch.ones(8, 16, dtype=torch.int8))
    offset, scale = torch.zeros(8, dtype=torch.int32), torch.ones(8)
    args = (weight, offset, scale, None, 8, 0.0, 0, False)
    x = torch.ones(2, 16, dtype=torch.int8)
    assert torch.equal(call(x, *args), op(x, *args))
    assert call.binding.bound
    with pytest.raises(NativeArgumentError, match=r"x is torch.float32"):
        call(x.float(), *args)
    with pytest.raises(NativeArgumentError, match="depth 16"):
        call(torch.ones(2, 32, dtype=torch.int8), *args)
    with pytest.raises(NativeArgumentError, match="holds 16 channels"):
        call(x, weight, offset, scale, None, 4096, 0.0, 0, False)  # another literal
    assert torch.equal(call(x[:1], *args), op(x[:1], *args))
    bias = torch.arange(8.0)  # a tensor where the binding had None
    with_bias = (weight, offset, scale, bias, *args[4:])
    assert torch.equal(call(x, *with_bias), op(x, *with_bias))
    with pytest.raises(NativeArgumentError, match="bias"):
        call(x, weight, offset, scale, bias[:4], *args[4:])


def test_a_copied_graph_binds_its_own_constants(lowered) -> None:
    bound, _, x = _fresh(lowered)
    with torch.no_grad():
        before = bound(x)
        twin = copy.deepcopy(bound)
        for name in _weights(twin).values():
            getattr(twin, name).zero_()
        assert torch.equal(bound(x), before)
        assert not torch.equal(twin(x), before)
    bindings = [n.target.binding for n in twin.graph.nodes if isinstance(n.target, BoundCall)]
    assert all(isinstance(b, Binding) for b in bindings)


def test_linear16_checks_its_constants() -> None:
    """``linear16`` read its weight unchecked before (a crafted ``out_features`` or a
    truncated weight walked past it); it now runs ``linear``'s contract for its constants."""
    weight = pack(torch.ones(8, 16, dtype=torch.int8))
    offset, scale, x = torch.zeros(8, dtype=torch.int32), torch.ones(8), torch.randn(2, 16)
    ops = torch.ops.quantree
    assert ops.linear16(x, 0.01, -32768, 32767, weight, offset, scale, None, 8).shape == (2, 8)
    with pytest.raises(NativeArgumentError, match=r"quantree\.linear16: weight .* holds 16"):
        ops.linear16(x, 0.01, -32768, 32767, weight, offset, scale, None, 4096)
    with pytest.raises(NativeArgumentError, match=r"quantree\.linear16: weight .* depth 16"):
        ops.linear16(torch.randn(2, 64), 0.01, -32768, 32767, weight, offset, scale, None, 8)
    with pytest.raises(NativeArgumentError, match=r"quantree\.linear16: scale"):
        ops.linear16(x, 0.01, -32768, 32767, weight, offset, scale[:4], None, 8)


def test_pooling_binds_its_geometry() -> None:
    op = torch.ops.quantree.max_pool2d.default
    call = BoundCall(op, op, None, BoundMaxPool2d)
    x = torch.randint(-128, 127, (1, 4, 6, 6), dtype=torch.int8)
    geometry = ([2, 2], [2, 2], [0, 0], [1, 1], False)
    assert torch.equal(call(x, *geometry), op(x, *geometry)) and call.binding.bound
    y = torch.randint(-128, 127, (2, 4, 8, 8), dtype=torch.int8)  # other sizes: still bound
    assert torch.equal(call(y, *geometry), op(y, *geometry))
    with pytest.raises(NativeArgumentError, match="stride"):
        call(x, [2, 2], [0, 2], [0, 0], [1, 1], False)
    with pytest.raises(NativeArgumentError, match=r"x is torch\.float32"):
        call(x.float(), *geometry)
    assert torch.equal(call(x, *geometry), op(x, *geometry))


def test_each_input_shape_keeps_its_own_kernel_call(lowered) -> None:
    """A bound conv2d / linear keeps its kernel call per input shape (``plans``): another
    batch gets its own, the first one's still gives its result, and a rebind drops them."""
    bound, checked, x = _fresh(lowered)
    three = torch.cat([x, x[:1] * 0.5])
    with torch.no_grad():
        for inputs in (x, three, x):
            assert torch.equal(bound(inputs), checked(inputs))
    targets = [n.target for n in bound.graph.nodes if isinstance(n.target, BoundCall)]
    convs = [t.binding for t in targets if t.op.__name__ == "conv2d.default"]
    assert convs and all(len(b.plans) == 2 for b in convs)
    convs[0].unbind()
    assert convs[0].plans == {}


@pytest.mark.parametrize(
    "geometry",
    [(8, 2, 3, 1, [1], 2, 1), (2, 16, 1, 1, [0], 1, 1), (16, 32, 4, 2, [1, 2], 1, 1),
     (24, 24, 3, 1, [2], 2, 24)],
    ids=["small", "pointwise", "gemm", "depthwise"],
)  # fmt: skip
def test_conv16_binds_its_constants_and_equals_the_op(geometry) -> None:
    """A 1-d ``conv16`` is bound per node: equal to the checked op on every layout and
    length (tap by tap, GEMM and depthwise routes alike), a shrunk constant refused, a
    geometry reaching far beyond its input and a 2-d input run as the op."""
    from test_conv1d_layout import inputs, layer

    from quantree.backends.cpu.native.bound_calls import BoundConv16
    from quantree.backends.cpu.native.direct import IMPLEMENTATIONS
    from quantree.backends.cpu.ops.conv1d import stages_in_bounds

    c, o, k, s, p, d, groups = geometry
    w, hi_off, hi_scale, bias = layer(c, o, k, groups)
    _, lo_off, lo_scale, _ = layer(c, o, k, groups, seed=2)
    op = torch.ops.quantree.conv16.default
    call = BoundCall(op, IMPLEMENTATIONS["conv16"], None, BoundConv16)
    consts = (w, hi_off, hi_scale, lo_off, lo_scale, bias, o, [k], [s], p, [d], groups)
    head = (4.0 / 32767, -32768, 32767)
    for length in (257, 40):
        for name, x in inputs(2, c, length, torch.float32).items():
            assert torch.equal(call(x, *head, *consts), op(x, *head, *consts)), name
            assert call.binding.bound
    short = torch.randn(1, c, 2)  # a span far beyond the input: the op's conv2d route
    far = (*consts[:8], [5000], [5000], consts[10], groups)
    assert not stages_in_bounds(short, [k], [5000], [5000], [d])
    assert torch.equal(call(short, *head, *far), op(short, *head, *far))
    x4 = torch.randn(1, c, 3, 5)
    geometry_2d = (*consts[:7], [k, 1], [s, 1], [p[0], 0], [d, 1], groups)
    if len(p) == 1:
        assert torch.equal(call(x4, *head, *geometry_2d), op(x4, *head, *geometry_2d))
    x = torch.randn(1, c, 50)
    with pytest.raises(NativeArgumentError, match="weight"):
        call(x, *head, _smaller(w), *consts[1:])
