"""A lowered model's chains of layers run as one native call (``native/chains.py``) and give
the per-op forward's bits (the same kernels read the same values), on every input layout,
after its weights change, once saved and loaded; the graph still shows every op."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.chains import ChainCall, find_chains
from quantree.backends.cpu.native.checks import NativeArgumentError


class Convs(nn.Module):
    """Convolution (+ReLU), depthwise, max pooling, a grouped stride-2 convolution, a
    sigmoid (a table), flatten and a classifier: one straight chain."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pool = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=2)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(torch.relu(self.dw(torch.relu(self.c1(x)))))
        y = torch.sigmoid(self.c2(y))
        return self.fc(torch.flatten(y, 1))


class Residual(nn.Module):
    """Two residual blocks: one adding its input back, one a 1x1 stride-2 projection of it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.a1, self.a2 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.b1 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.b2, self.down = nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(16, 32, 1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.relu(self.stem(x))
        u = torch.relu(u + self.a2(torch.relu(self.a1(u))))
        return torch.relu(self.b2(torch.relu(self.b1(u))) + self.down(u))


def lowered(
    seed: int = 0, model_type: type = Convs
) -> tuple[nn.Module, fx.GraphModule, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = model_type().eval()
    data = [(torch.randn(2, 3, 16, 16),) for _ in range(4)]  # batch 2: a dynamic batch
    low = qt.quantize(model, data[0], data, backend=CPU, progress=False)
    return model, low, [torch.randn(1, 3, 16, 16) for _ in range(3)]


def per_op(low: fx.GraphModule) -> fx.GraphModule:
    """The lowered graph's own forward: one call per op (what the chains must equal)."""
    return fx.GraphModule(low, low.graph)


def chain_calls(low: fx.GraphModule) -> list[ChainCall]:
    return [v for v in type(low).forward.__globals__.values() if isinstance(v, ChainCall)]


def test_the_chain_equals_the_per_op_forward_bit_for_bit() -> None:
    _, low, inputs = lowered()
    ops = per_op(low)
    (chain,) = chain_calls(low)
    assert {"conv2d", "max_pool2d", "lookup", "linear", "dequantize"} <= set(chain.names)
    with torch.no_grad():
        for x in inputs:
            for _ in range(2):  # the first call plans, the second runs natively
                assert torch.equal(low(x), ops(x))
    assert any(plan is not None for plan in chain.plans.values())


def test_residual_adds_run_in_their_chain() -> None:
    _, low, inputs = lowered(model_type=Residual)
    ops = per_op(low)
    calls = chain_calls(low)
    assert any("binary" in c.names and c.n_inputs == 2 for c in calls)
    with torch.no_grad():
        for x in inputs:
            for _ in range(2):
                assert torch.equal(low(x), ops(x))
    assert all(plan is not None for c in calls for plan in c.plans.values())


def test_the_graph_still_shows_every_op() -> None:
    _, low, _ = lowered()
    names = [str(n.target) for n in low.graph.nodes if n.op == "call_function"]
    assert names.count("quantree.conv2d.default") == 3
    assert "quantree.linear.default" in names
    assert len(find_chains(low.graph)) == 1


def test_other_input_shapes_and_layouts_run_as_the_ops_do() -> None:
    _, low, _ = lowered()
    ops = per_op(low)
    with torch.no_grad():
        for x in (
            torch.randn(3, 3, 16, 16),
            torch.randn(1, 3, 16, 16).contiguous(memory_format=torch.channels_last),
            torch.randn(2, 3, 16, 32)[..., ::2],  # strided
        ):
            for _ in range(2):
                assert torch.equal(low(x), ops(x))


def test_weights_changed_after_planning_are_read() -> None:
    _, low, inputs = lowered()
    with torch.no_grad():
        low(inputs[0])
        low(inputs[0])  # planned and run natively
        weight = next(t for n, t in low.named_buffers() if "weight" in n)
        weight.copy_(torch.flip(weight, [0]))  # in place: the version moves
        assert torch.equal(low(inputs[1]), per_op(low)(inputs[1]))
        assert torch.equal(low(inputs[1]), per_op(low)(inputs[1]))
    (chain,) = chain_calls(low)
    assert all(plan is not None for plan in chain.plans.values())  # planned anew


def test_copies_and_saved_models_give_the_same_bits(tmp_path) -> None:
    _, low, inputs = lowered()
    with torch.no_grad():
        want = [low(x) for x in inputs]
        twin = copy.deepcopy(low)
        path = tmp_path / "convs.pt2"
        save(low, path, (inputs[0],))
        loaded = load(path)
        assert chain_calls(loaded)
        for x, y in zip(inputs, want, strict=True):
            assert torch.equal(twin(x), y)
            for _ in range(2):
                assert torch.equal(loaded(x), y)


def test_a_recompiled_module_runs_its_ops_again() -> None:
    _, low, inputs = lowered()
    with torch.no_grad():
        want = low(inputs[0])
        low.recompile()
        assert not chain_calls(low)
        assert torch.equal(low(inputs[0]), want)


def test_a_constant_replaced_by_a_wrong_one_is_refused_before_any_kernel() -> None:
    _, low, inputs = lowered()
    with torch.no_grad():
        low(inputs[0])
        low(inputs[0])  # planned and run natively
        name = next(n for n, _ in low.named_buffers() if "weight" in n)
        setattr(low, name, torch.zeros(5, dtype=torch.int8))
        with pytest.raises(NativeArgumentError):
            low(inputs[0])
