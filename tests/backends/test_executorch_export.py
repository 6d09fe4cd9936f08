"""ExecuTorch export: the reference graph lowered with XNNPACK, run with ExecuTorch's runtime.

Every model's ExecuTorch output is within ``SQNR_VS_REFERENCE_DB`` of quantree's reference
graph (XNNPACK requantizes with its own rounding: an output LSB here and there), and no
quantize/dequantize is left to portable ops where XNNPACK fuses the pattern.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from quantree.backends import CPU
from quantree.core.lower import lower as core_lower

pytest.importorskip(
    "executorch.exir", reason="ExecuTorch tests need executorch (see docs/deployment-executorch.md)"
)

import quantree as qt
from quantree.backends.executorch import lower_executorch, run_executorch
from quantree.backends.executorch.dialect import to_xnnpack_dialect
from quantree.core.qdq import is_dequantize

from support import batches

SQNR_VS_REFERENCE_DB = 30.0


class SmallCnn(nn.Module):
    """benchmarks/cnn_mlp_latency.py's CNN, narrower: three conv+relu, flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, 2, 1)
        self.c3, self.fc = nn.Conv2d(16, 16, 3, 2, 1), nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c3(self.c2(self.c1(x).relu()).relu()).relu()
        return self.fc(torch.flatten(y, 1))


class Residual(nn.Module):
    """conv -> relu -> conv, a residual add read by two users, pooling, two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.body = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x).relu()
        y = (self.body(s) + s).relu()
        pooled = nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.fc2(self.fc1(pooled).relu())


class Normed(nn.Module):
    """linear -> layer norm -> linear: the recipe quantizes only the linears' inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def _reference(model: nn.Module, shape: tuple[int, ...], **options) -> torch.fx.GraphModule:
    data = batches(shape, n=8)
    return qt.quantize(
        model.eval(),
        data[0],
        data,
        progress=False,
        dynamic_batch=False,
        **options,
        backend="reference",
    )


def _check_close(ref: torch.fx.GraphModule, program: bytes | Path, shape: tuple[int, ...]) -> None:
    for (x,) in batches(shape, n=3, seed=1):
        (got,) = run_executorch(program, (x,))
        (want,) = tree_leaves(ref(x))
        assert qt.sqnr(want, got) >= SQNR_VS_REFERENCE_DB


@pytest.mark.parametrize(("model", "shape"), [(SmallCnn, (1, 3, 16, 16)), (Residual, (1, 3, 8, 8))])
def test_int8_model_runs_in_xnnpack_close_to_reference(model, shape, tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = _reference(model(), shape)
    lowered = lower_executorch(ref, batches(shape, n=1)[0])
    path = tmp_path / "model.pte"
    path.write_bytes(lowered.buffer)
    _check_close(ref, path, shape)
    left = lowered.delegation.portable_ops
    assert not [op for op in left if "quantize" in op], lowered.delegation.render()
    assert lowered.delegation.delegate_calls >= 1
    assert lowered.delegation.fp32_layers == ()


def test_dialect_folds_biases_and_gives_each_user_its_own_dequantize() -> None:
    torch.manual_seed(0)
    ref = _reference(Residual(), (1, 3, 8, 8))
    gm = to_xnnpack_dialect(ref)
    dqs = [n for n in gm.graph.nodes if is_dequantize(n)]
    assert all(n.args[-1] == torch.int8 for n in dqs)  # no int32 bias dequantize left
    assert all(len(n.users) == 1 for n in dqs)
    assert all("out_dtype" not in n.kwargs for n in dqs)
    (x,) = batches((1, 3, 8, 8), n=1, seed=2)[0]
    assert torch.equal(tree_leaves(gm(x))[0], tree_leaves(ref(x))[0])
    assert len(list(ref.graph.nodes)) != len(list(gm.graph.nodes))  # the copy was rewritten


def test_layers_xnnpack_cannot_run_in_int8_are_named_and_fixed_by_every_op() -> None:
    torch.manual_seed(0)
    model, shape = Normed(), (4, 16)
    ref = _reference(model, shape)
    with pytest.warns(qt.QuantreeWarning, match=r"ActivationPoints\.EVERY_OP") as caught:
        lowered = lower_executorch(ref, batches(shape, n=1)[0])
    assert "linear" in str(caught[0].message)
    assert len(lowered.delegation.fp32_layers) == 2
    assert not [op for op in lowered.delegation.portable_ops if "dequantize_per_channel" in op]
    _check_close(ref, lowered.buffer, shape)
    # the fix the warning names: every activation quantized, so XNNPACK runs both in int8
    every = _reference(
        model, shape, quantizer=qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)
    )
    lowered = lower_executorch(every, batches(shape, n=1)[0])
    assert lowered.delegation.fp32_layers == ()
    _check_close(every, lowered.buffer, shape)


def test_cpu_lowered_model_is_refused_and_the_reference_exports(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, shape = SmallCnn().eval(), (1, 3, 16, 16)
    data = batches(shape, n=4)
    # qt.quantize's output keeps the reference graph it was lowered from: that one exports.
    kept = qt.quantize(model, data[0], data, progress=False, backend="cpu", dynamic_batch=False)
    assert qt.export_executorch(kept, data[0], tmp_path / "kept.pte").stat().st_size > 0
    # A CPU-lowered graph without it (core's lower, or one loaded from a file) is refused.
    prepared = qt.prepare(qt.capture(model, data[0], dynamic_batch=False), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    lowered = core_lower(qt.convert(prepared), CPU)
    with pytest.raises(qt.QuantreeError, match="backend='reference'"):
        qt.export_executorch(lowered, data[0], tmp_path / "model.pte")
    assert not (tmp_path / "model.pte").exists()
    ref = qt.quantize(
        model, data[0], data, progress=False, dynamic_batch=False, backend="reference"
    )
    assert qt.export_executorch(ref, data[0], tmp_path / "model.pte").stat().st_size > 0


def test_float_model_is_refused() -> None:
    with pytest.raises(qt.QuantreeError, match=r"qt\.convert"):
        lower_executorch(torch.fx.symbolic_trace(SmallCnn()), (torch.randn(1, 3, 16, 16),))
