"""prepare_qat / freeze_qat / convert of a QAT model (quantree.core.training).

What holds exactly: one fake-quant module per sharing group, named as prepare's observers;
a QAT model converts to the reference graph whose arithmetic its forward is (equal outputs);
the int32 bias is derived in the forward, so the input and weight scales get gradients
through it; batch norm is folded at prepare and its folded weight trains. The lowered CPU
model matches the QAT model within one step of the output's grid (its kernels round in
integer arithmetic where the reference graph rounds float).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.qdq import DEQUANTIZE_PER_CHANNEL
from quantree.core.stages import GROUPS_KEY
from quantree.core.training.fake_quant import (
    DerivedFakeQuant,
    FixedFakeQuant,
    LearnedFakeQuant,
)
from quantree.core.training.qat import fake_quant_modules

from support import batches

torch.manual_seed(0)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return torch.sigmoid(self.fc(y.mean((2, 3))))


def _convnet(seed: int = 0) -> nn.Module:
    # Seeded here, not by the module's manual_seed: under xdist the global generator's state
    # depends on which tests ran before in the worker.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ConvNet()
        with torch.no_grad():  # non-trivial running statistics, so the fold changes the weight
            model.bn.running_mean.uniform_(-0.5, 0.5)
            model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _step(qat: torch.fx.GraphModule, args: tuple[torch.Tensor, ...], lr: float = 1e-2) -> float:
    named = list(qat.named_parameters())
    optimizer = torch.optim.SGD(
        [
            {"params": [p for n, p in named if not n.endswith(".scale")], "lr": lr},
            {"params": [p for n, p in named if n.endswith(".scale")], "lr": lr * 1e-2},
        ]
    )
    loss = qat(*args).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def test_one_fake_quant_per_group_and_kinds() -> None:
    data = batches((2, 3, 6, 6), n=3)
    qat = qt.prepare_qat(qt.capture(_convnet(), data[0]), qt.Int8Quantizer(), data)
    groups = qat.meta[GROUPS_KEY]
    modules = fake_quant_modules(qat)
    assert len(modules) == len(groups)
    kinds = {type(m) for m in modules.values()}
    assert kinds == {LearnedFakeQuant, DerivedFakeQuant, FixedFakeQuant}  # sigmoid: fixed
    for group in groups.values():
        if group.observer is not None:  # where the observer stood
            assert isinstance(modules[group.observer], LearnedFakeQuant)
    called = [qat.get_submodule(str(n.target)) for n in qat.graph.nodes if n.op == "call_module"]
    assert not any(isinstance(m, qt.Observer) for m in called)  # nothing observes any more


def test_bias_is_derived_in_the_forward_so_scales_learn_through_it() -> None:
    model = nn.Sequential(nn.Linear(5, 3)).eval()
    data = batches((4, 5), n=3)
    qat = qt.prepare_qat(qt.capture(model, data[0]), qt.Int8Quantizer(), data)
    derived = [m for m in fake_quant_modules(qat).values() if isinstance(m, DerivedFakeQuant)]
    assert len(derived) == 1
    bias = derived[0]
    inputs, weight = bias.sources
    expected = inputs.current_scale().reshape(()) * weight.current_scale()
    torch.testing.assert_close(bias.qparams().scale, expected.detach(), rtol=1e-6, atol=0)
    bias(torch.full((3,), 0.3, requires_grad=True)).sum().backward()
    assert inputs.scale.grad is not None and inputs.scale.grad.abs().sum() > 0
    assert weight.scale.grad is not None and weight.scale.grad.abs().sum() > 0


def test_batch_norm_folded_at_prepare_and_trained() -> None:
    model = _convnet()
    data = batches((2, 3, 6, 6), n=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qat = qt.prepare_qat(qt.capture(model, data[0]), qt.Int8Quantizer(), data)
    folded = {n: p.detach().clone() for n, p in qat.named_parameters() if "_folded_" in n}
    assert folded
    targets = {str(n.target) for n in qat.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in t for t in targets)
    with torch.no_grad():
        first = qat(*data[0])
    for _ in range(3):
        _step(qat, data[0], lr=5e-2)
    for name, value in qat.named_parameters():
        if name in folded:  # the folded weight and bias train
            assert not torch.equal(value, folded[name]), name
    with torch.no_grad():  # and move the output by at least one step of its 1/256 grid
        assert not torch.equal(qat(*data[0]), first)
    ref = qt.convert(qat)
    assert not any("batch_norm" in str(n.target) for n in ref.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ref(*data[1]), qat(*data[1]))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_freeze_qat_stops_scales_not_weights() -> None:
    data = batches((2, 3, 6, 6), n=3)
    gm = qt.capture(_convnet(), data[0])
    qat = qt.freeze_qat(qt.prepare_qat(gm, qt.Int8Quantizer(), data))
    learned = [m for m in fake_quant_modules(qat).values() if isinstance(m, LearnedFakeQuant)]
    scales = [m.scale.detach().clone() for m in learned]
    weights = {n: p.detach().clone() for n, p in qat.named_parameters() if p.requires_grad}
    _step(qat, data[0])
    assert all(torch.equal(m.scale, s) for m, s in zip(learned, scales, strict=True))
    assert any(not torch.equal(p, weights[n]) for n, p in qat.named_parameters() if n in weights)
    qt.freeze_qat(qat, frozen=False)
    assert any(m.learning for m in learned)
    off = qt.prepare_qat(gm, qt.Int8Quantizer(), data, learn_scales=False)
    assert not any(m.learning for m in fake_quant_modules(off).values())


def test_freeze_qat_refuses_a_model_prepare_qat_did_not_make() -> None:
    data = batches((2, 3, 6, 6), n=2)
    gm = qt.capture(_convnet(), data[0])
    with pytest.raises(qt.QuantreeError, match=r"prepare it with quantree\.prepare_qat"):
        qt.freeze_qat(qt.prepare(gm, qt.Int8Quantizer()))
    qt.freeze_qat(qt.prepare_qat(gm, qt.Int8Quantizer(), data))  # the fix it names


class CharModel(nn.Module):
    """The char-LM's shape, small: embedding, LSTM, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        return self.head(out)


def _tokens(n: int, seed: int = 0) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 20, (2, 6), generator=g),) for _ in range(n)]


def test_lowered_cpu_model_matches_the_qat_model_within_one_step(tmp_path) -> None:
    from quantree.backends import load, save

    data = _tokens(4)
    qat = qt.prepare_qat(qt.capture(CharModel().eval(), data[0]), qt.Int8Quantizer(), data)
    for _ in range(3):
        _step(qat, data[0])
    ref = qt.convert(qat)
    lowered = qt.lower(ref, "cpu")
    out = next(n for n in ref.graph.nodes if n.op == "output").args[0][0]
    step = float(out.args[1])  # the output's dequantize: its scale is one step
    with torch.no_grad():
        for args in _tokens(2, seed=1):
            expected = qat(*args)
            assert torch.equal(ref(*args), expected)
            assert (lowered(*args) - expected).abs().max() <= step * 1.001
    path = tmp_path / "qat.pt2"
    save(lowered, path, data[0])
    with torch.no_grad():
        assert torch.equal(load(path)(*data[1]), lowered(*data[1]))


class WideCharModel(CharModel):
    """CharModel with rows of 32 weights, more than the 16 levels 4 bits hold."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 32)
        self.rnn = nn.LSTM(32, 32, batch_first=True)
        self.head = nn.Linear(32, 20)


def test_w4a8_qat_learns_on_the_4_bit_grid_and_converts_to_it() -> None:
    """W4A8 weights fake-quantize to integers in [-8, 7] times each channel's scale (so at
    most 16 levels a channel), and convert to int8 storage in [-8, 7]."""
    data = _tokens(4)
    qat = qt.prepare_qat(qt.capture(WideCharModel().eval(), data[0]), qt.W4A8Quantizer(), data)
    for _ in range(3):
        _step(qat, data[0], lr=5e-2)
    ranges = []
    for node in qat.graph.nodes:
        module = qat.get_submodule(str(node.target)) if node.op == "call_module" else None
        if not isinstance(module, LearnedFakeQuant) or module.axis is None:
            continue
        ranges.append((module.quant_min, module.quant_max))
        if ranges[-1] != (-8, 7):
            continue
        weight = qat.get_parameter(str(node.args[0].target))
        with torch.no_grad():
            out = module(weight).movedim(module.axis, 0)
            q = out / module.current_scale().reshape(-1, *[1] * (out.dim() - 1))
        assert torch.allclose(q, q.round(), atol=1e-4) and q.min() >= -8 and q.max() <= 7
        assert max(len(torch.unique(row)) for row in out) <= 16
    # the LSTM's two matrices and the head at 4 bits; the embedding table stays int8
    assert sorted(ranges) == [(-127, 127)] + [(-8, 7)] * 3, ranges
    ref = qt.convert(qat)
    converted = 0
    for node in ref.graph.nodes:
        if node.target is DEQUANTIZE_PER_CHANNEL and node.args[-3:] == (-8, 7, torch.int8):
            q = getattr(ref, str(node.args[0].target))
            assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
            converted += 1
    assert converted == 3


@pytest.mark.skipif(
    os.environ.get("QUANTREE_QAT_FULL") != "1",
    reason="ONNX export takes ~10 s; QUANTREE_QAT_FULL=1 runs it (a QAT model converts to the "
    "graph PTQ gives, node for node, which the ONNX tests export)",
)
def test_onnx_export_of_a_qat_model(tmp_path) -> None:
    pytest.importorskip("onnx")
    data = _tokens(3)
    qat = qt.prepare_qat(qt.capture(CharModel().eval(), data[0]), qt.Int8Quantizer(), data)
    _step(qat, data[0])
    path = tmp_path / "qat.onnx"
    qt.export_onnx(qt.convert(qat), data[0], path)
    assert path.stat().st_size > 0


def test_pt2e_quantizer_with_recurrent_rules() -> None:
    xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    quantizer = xnnpack.XNNPACKQuantizer().set_global(xnnpack.get_symmetric_quantization_config())
    data = _tokens(3)
    gm = qt.capture(CharModel().eval(), data[0])
    composed = qt.from_pt2e(quantizer) + qt.recurrent_rules()
    qat = qt.prepare_qat(gm, composed, data)
    names = {str(n.target) for n in qat.graph.nodes if n.op == "call_module"}
    lstm = next(n for n in qat.graph.nodes if "lstm" in str(n.target))
    assert all(
        a.op == "call_module" and a.target in names
        for a in [lstm.args[0], *lstm.args[1], *lstm.args[2]]
    )  # input, states, weights and biases all fake-quantized
    loss = _step(qat, data[0])
    assert loss == loss
    ref = qt.convert(qat)
    prepared = qt.prepare(gm, composed)
    qt.calibrate(prepared, data, progress=False)
    ptq = qt.convert(prepared)
    assert [(n.op, n.target) for n in ref.graph.nodes] == [
        (n.op, n.target) for n in ptq.graph.nodes
    ]
    with torch.no_grad():
        assert torch.equal(ref(*data[1]), qat(*data[1]))


class WithMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, memory: torch.Tensor):
        return self.lin(x), torch.tanh(memory) * 2


def test_calibration_that_never_reaches_a_point_names_it_and_the_fix() -> None:
    empty = [(torch.randn(8, 4), torch.randn(0, 4)) for _ in range(3)]
    gm = qt.capture(WithMemory().eval(), empty[0])
    with pytest.raises(qt.QuantreeError, match="never observed") as error:
        qt.prepare_qat(gm, qt.Int8Quantizer(), empty)
    assert "tanh" in str(error.value) and "calibration inputs" in str(error.value)
    full = [(torch.randn(8, 4), torch.randn(3, 4)) for _ in range(3)]
    gm = qt.capture(WithMemory().eval(), full[0])  # a memory length export keeps
    qat = qt.prepare_qat(gm, qt.Int8Quantizer(), full)  # the fix: data that reaches it
    with torch.no_grad():
        assert torch.equal(qt.convert(qat)(*full[0])[1], qat(*full[0])[1])


def test_int32_constant_past_its_range_saturates_at_the_top() -> None:
    """A bias derived from a zero initial state's floor scale overflows int32: it stays at
    the top (float32 clamps 2**31 - 1 to 2**31, which a plain cast wraps to -2**31), which
    is what the QAT model's fake quantization computes too."""
    from quantree.core.qdq import dequantize_tensor, quantize_tensor
    from quantree.core.training.fake_quant import fake_quantize_ste

    lo, hi = qt.QDtype.INT32.bounds
    p = qt.QParams(
        torch.tensor([1e-9, 1e-9]), torch.zeros(2, dtype=torch.int64), qt.QDtype.INT32, lo, hi, 0
    )
    bias = torch.tensor([5.0, -5.0])
    q = quantize_tensor(bias, p)
    assert q.tolist() == [hi, lo]
    assert torch.equal(dequantize_tensor(q, p), fake_quantize_ste(bias, p))


def test_without_calibration_data_calibrate_then_train() -> None:
    """``prepare_qat(gm, quantizer)``: calls without gradients calibrate (float passes
    through), the first training step starts fake quantization from what they observed: the
    same model as ``prepare_qat(gm, quantizer, data)``, the optimizer made before kept."""
    data = batches((2, 3, 6, 6), n=3)
    gm = qt.capture(_convnet(), data[0])
    # the no-grad check below is one more calibration call (on data[0]): given sees it too
    given = qt.prepare_qat(gm, qt.Int8Quantizer(), [*data, data[0]])
    qat = qt.prepare_qat(gm, qt.Int8Quantizer())
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    qt.calibrate(qat, data, progress=False)
    with torch.no_grad():
        # still calibrating: float, with batch norm folded into the convolution (so equal up
        # to the fold's rounding, one float32 ulp here)
        torch.testing.assert_close(qat(*data[0]), gm(*data[0]), rtol=1e-6, atol=1e-6)
    loss = qat(*data[0]).square().mean()  # with gradients: starts
    with torch.no_grad():
        assert torch.equal(qat(*data[1]), given(*data[1]))
    loss.backward()
    optimizer.step()
    scales = [m.scale for m in fake_quant_modules(qat).values() if isinstance(m, LearnedFakeQuant)]
    assert all(s.grad is not None for s in scales if s.requires_grad)


def test_without_any_calibration_the_first_step_calibrates_on_its_own_inputs() -> None:
    data = batches((2, 3, 6, 6), n=2)
    gm = qt.capture(_convnet(), data[0])
    qat = qt.prepare_qat(gm, qt.Int8Quantizer())
    qat(*data[0]).square().mean().backward()
    first = qt.prepare_qat(gm, qt.Int8Quantizer(), data[:1])
    with torch.no_grad():
        assert torch.equal(qat(*data[1]), first(*data[1]))
    untouched = qt.prepare_qat(gm, qt.Int8Quantizer())
    with pytest.raises(qt.QuantreeError, match="never observed"):
        qt.convert(untouched)
