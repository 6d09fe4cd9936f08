"""The Python around a lowered model's kernels: direct calls that check only where tensors
can be, inputs bound without a pytree flatten, shape guards that remember what passed. None
of it may change an output bit, an error, or how the model copies and saves."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.direct import DirectCall
from quantree.core.capturing.shape_guards import PassedShapes, ShapeGuardFailed, _reads_only_sizes

from support import batches


class Small(nn.Module):
    """conv -> relu -> linear, and an LSTM: a graph of several direct calls, one with a list
    of tensors (the recurrent layer's weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.lstm = nn.LSTM(8, 8, 2)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).permute(2, 0, 1)
        return self.fc(self.lstm(y)[0])


@pytest.fixture(scope="module")
def lowered() -> tuple[nn.Module, torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model, data = Small().eval(), batches((1, 6, 10), n=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        low = qt.quantize(model, data[0], data, backend=CPU, progress=False)
    return model, low, data


def through_the_dispatcher(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same graph calling every op through torch.ops, with torch's own pytree code."""
    slow = copy.deepcopy(gm)
    for node in slow.graph.nodes:
        if isinstance(node.target, DirectCall):
            node.target = node.target.op
    info = slow.graph._codegen.pytree_info
    slow.graph._codegen = torch.fx.graph._PyTreeCodeGen(info)
    slow._guards_fn = copy.deepcopy(gm._guards_fn)
    slow._guards_fn.__class__ = torch.nn.Module  # torch's guard call, no remembered shapes
    slow.recompile()
    return slow


def test_same_bits_as_the_dispatcher_path_and_after_copy_and_save(lowered, tmp_path) -> None:
    _, low, data = lowered
    assert "tree_flatten_spec" not in low.code and "tree_unflatten" not in low.code
    slow = through_the_dispatcher(low)
    assert "tree_flatten_spec" in slow.code
    save(low, tmp_path / "m.pt2", data[0])
    loaded = load(tmp_path / "m.pt2")
    copied = copy.deepcopy(low)
    with torch.no_grad():
        for args in data:
            want = slow(*args)
            for got in (low(*args), low(*args), copied(*args), loaded(*args)):
                assert torch.equal(got, want)


def test_a_wrong_shape_after_a_right_one_raises_every_time(lowered) -> None:
    _, low, data = lowered
    assert isinstance(low._guards_fn, PassedShapes)
    low(*data[0])
    bad = torch.randn(1, 7, 10)  # the conv's channels: the length (dim 2) varies
    messages = []
    for _ in range(2):  # a refused shape is not remembered
        with pytest.raises(ShapeGuardFailed) as caught:
            low(bad)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "input 'x' has shape (1, 7, 10), captured with (1, 6, *)" in messages[0]
    assert "dimension 1 was fixed at capture" in messages[0]
    low(*data[1])


def test_remembered_shapes_respect_the_guards_ranges() -> None:
    """A dynamic batch within its range passes (and is remembered), one outside raises."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    data = batches((4, 4), n=3)
    dims = ({0: torch.export.Dim("batch", min=3, max=6)},)
    low = qt.quantize(model, data[0], data, backend=CPU, dynamic_shapes=dims, progress=False)
    for n in (3, 5, 5, 6):
        assert torch.equal(low(torch.ones(n, 4)), low(torch.ones(n, 4)))
    passed = {shape[0][0] for shape in low._guards_fn.passed}
    assert {3, 5, 6} <= passed  # 4 too: calibration's batches went through the same guard
    for n in (7, 2, 7):
        with pytest.raises(ShapeGuardFailed):
            low(torch.ones(n, 4))
    assert not {7, 2} & {shape[0][0] for shape in low._guards_fn.passed}


def test_guards_that_read_more_than_sizes_are_not_remembered() -> None:
    def wrapper(*args):
        return inner(*args)

    def inner(*args):
        torch._assert(args[0].stride()[0] == 4, "Guard failed")

    assert not _reads_only_sizes(wrapper)

    def sizes(*args):
        torch._assert(args[0].size()[0] == 4, "Guard failed")

    def size_wrapper(*args):
        return sizes(*args)

    assert _reads_only_sizes(size_wrapper)

    def bounded(*args):  # the builtin max of sizes: still sizes only (CRNN's guard)
        torch._assert(max(args[0].size()[2], 1) >= 2, "Guard failed")

    def bounded_wrapper(*args):
        return bounded(*args)

    assert _reads_only_sizes(bounded_wrapper)


class Subclass(torch.Tensor):
    pass


def test_a_tensor_subclass_in_a_list_argument_goes_through_the_op() -> None:
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    call = DirectCall(torch.ops.quantree.quantize.default, lambda *args: "direct", (a, 3, [b, 2]))
    call.op = lambda *args: "op"
    plain = torch.ones(2)
    assert call(plain, 3, [plain, 2]) == "direct"
    assert call(plain, 3, [plain.as_subclass(Subclass), 2]) == "op"
    assert call(plain.as_subclass(Subclass), 3, [plain, 2]) == "op"
    assert call(plain, 3, [plain, 2], plain) == "direct"  # another arity: every argument looked at
    assert call(plain, 3, [plain, 2], plain.as_subclass(Subclass)) == "op"


def test_buffers_read_directly_still_behave_as_buffers(lowered) -> None:
    _, low, data = lowered
    gm = copy.deepcopy(low)
    from quantree.backends.cpu.native.fast_attributes import read_buffers_directly

    read_buffers_directly(gm)
    name = next(n.target for n in gm.graph.find_nodes(op="get_attr") if "." not in n.target)
    assert isinstance(type(gm).__dict__[name], property)
    before = gm(*data[0])
    weight = getattr(gm, name)
    assert name in dict(gm.named_buffers()) and name in gm.state_dict()
    setattr(gm, name, weight.clone())  # assigning a tensor replaces the buffer
    assert getattr(gm, name) is gm._buffers[name] and torch.equal(gm(*data[0]), before)
    delattr(gm, name)
    assert not hasattr(gm, name)
    setattr(gm, name, 3)  # a plain attribute once it is no buffer
    assert getattr(gm, name) == 3 and name not in gm._buffers
    delattr(gm, name)
    gm.register_buffer(name, weight)
    assert torch.equal(gm(*data[0]), before)
    assert type(gm) is not type(low)  # fx gives the copy its own class
