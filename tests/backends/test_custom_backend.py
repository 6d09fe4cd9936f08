"""examples/custom_backend.py: a user's backend on quantree's public API, each behaviour."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import quantree as qt
from quantree.backends import CPU

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_backend.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_backend_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def reference(example: ModuleType, quantizer: qt.Quantizer | None = None):
    torch.manual_seed(0)
    model = example.EncoderDecoder().eval()
    data = [(torch.randn(16, 32),) for _ in range(6)]
    return qt.quantize(
        model, data[0], data, quantizer=quantizer, progress=False, backend="reference"
    ), data


def linear_scopes(gm: torch.fx.GraphModule) -> list[str]:
    return [
        next(reversed(n.meta["nn_module_stack"].values()))[0]
        for n in gm.graph.nodes
        if n.target == torch.ops.aten.linear.default
    ]


def test_uses_public_api_only():
    source = EXAMPLE.read_text()
    assert "quantree._" not in source and "from quantree._" not in source
    imports = [line for line in source.splitlines() if "import" in line and "quantree" in line]
    assert imports == ["import quantree as qt"]
    used = set(re.findall(r"\bqt\.(\w+)", source))
    assert used and used <= set(qt.__all__), used - set(qt.__all__)


def test_replaces_fused_linear_relu_with_its_own_op(example):
    ref, data = reference(example)
    lowered = qt.lower(ref, example.accel_backend("encoder"))
    assert len(example.accel_ops(lowered)) == 2
    assert not any(s.startswith("encoder") for s in linear_scopes(lowered))
    with torch.no_grad():
        for args in data[:3]:
            assert qt.sqnr(ref(*args), lowered(*args)) >= 35.0


def test_quantizes_weights_into_its_own_tensor_type(example):
    ref, _ = reference(example)
    calls: list[qt.QParams] = []

    def spy(x: torch.Tensor, p: qt.QParams) -> torch.Tensor:
        calls.append(p)
        return example.accel_quantize(x, p)

    backend = qt.Backend(
        "spy", example.accel_backend("encoder").rules, spy, example.accel_dequantize
    )
    lowered = qt.lower(ref, backend)
    assert len(calls) == 2 and all(p.axis == 0 for p in calls)
    for op in example.accel_ops(lowered):
        weight = getattr(lowered, str(op.args[1].target))
        assert isinstance(weight, example.AccelWeight)
        assert weight.values().dtype == torch.int8 and weight.scale.shape == (weight.shape[0],)


def test_scope_decides_what_is_lowered(example):
    ref, _ = reference(example)
    decoder = qt.lower(ref, example.accel_backend("decoder"))
    assert len(example.accel_ops(decoder)) == 1  # decoder.0 + relu; decoder.2 has no relu
    assert sorted(linear_scopes(decoder)) == ["decoder.2", "encoder.0", "encoder.2"]
    assert example.accel_ops(qt.lower(ref, example.accel_backend("head"))) == []


def test_annotation_decides_what_is_lowered(example):
    ref, _ = reference(example, qt.Int8Quantizer(per_channel=False))
    assert example.accel_ops(qt.lower(ref, example.accel_backend("encoder"))) == []


def test_composes_with_the_native_backend(example):
    ref, data = reference(example)
    lowered = qt.lower(ref, CPU + example.accel_backend("encoder"))
    assert len(example.accel_ops(lowered)) == 2
    native = [n for n in lowered.graph.nodes if n.target == torch.ops.quantree.linear.default]
    assert len(native) == 2 and linear_scopes(lowered) == []
    with torch.no_grad():
        assert qt.sqnr(ref(*data[0]), lowered(*data[0])) >= 35.0


def test_example_runs(example, capsys):
    example.main()
    out = capsys.readouterr().out
    assert "accel ops: 2" in out and "AccelWeight" in out
