"""Exports of a layer whose bias convert kept float (int32 could not hold it on its grid).

ONNX Runtime and XNNPACK quantize a float bias beside dequantized operands to int32 on input
scale x weight scale themselves, and so would cut it as convert refused to: ONNX Runtime's
output of such a 1-d convolution was all zeros. The exporters keep that bias out of the fused
kernel (``backends/float_bias.py``), so the runtimes follow the reference to
``VS_REFERENCE_DB``; XNNPACK, which cannot compile a 1-d convolution in fp32 on an int8 input,
is refused by name.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt

VS_REFERENCE_DB = 60.0


class Tiny(nn.Module):
    """A linear and a convolution on inputs and weights of range 1e-3, biases 1.0."""

    def __init__(self, conv: type[nn.Module]) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.conv = conv(8, 8, 3, padding=1)
        with torch.no_grad():
            for layer in (self.fc, self.conv):
                layer.weight.mul_(1e-3)  # type: ignore[operator]
                layer.bias.fill_(1.0)  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x.transpose(1, -1)), self.conv(x)


def _reference(conv: type[nn.Module], shape: tuple[int, ...]) -> tuple[torch.fx.GraphModule, tuple]:
    torch.manual_seed(0)
    data = [(torch.randn(*shape) * 1e-3,) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(Tiny(conv).eval(), data[0]), qt.Int8Quantizer())
        qt.calibrate(prepared, data)
        ref = qt.convert(prepared)
    layers = [n for n in ref.graph.nodes if n.name in ("linear", "conv1d", "conv2d")]
    assert len(layers) == 2 and all(n.args[2].op == "get_attr" for n in layers)  # kept float
    return ref, data[0]


def test_onnx_runtime_follows_the_float_bias(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    ref, x = _reference(nn.Conv1d, (2, 8, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = qt.export_onnx(ref, x, tmp_path / "tiny.onnx")
        from quantree.backends.onnx.export import run_onnx

        outs = run_onnx(path, x, int8_kernels=True)  # ONNX Runtime's fusion, as deployed
    for want, got in zip(ref(*x), outs, strict=True):
        assert qt.sqnr(want, got) >= VS_REFERENCE_DB


def test_executorch_runs_2d_layers_in_fp32_and_refuses_conv1d(tmp_path: Path) -> None:
    pytest.importorskip("executorch.exir", reason="needs executorch")
    from quantree.backends.executorch import run_executorch

    ref, x = _reference(nn.Conv2d, (2, 8, 6, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = qt.export_executorch(ref, x, tmp_path / "tiny.pte")
    for want, got in zip(ref(*x), run_executorch(program, x), strict=True):
        assert qt.sqnr(want, got) >= VS_REFERENCE_DB
    ref, x = _reference(nn.Conv1d, (2, 8, 16))
    with pytest.raises(qt.QuantreeError, match=r"node conv1d \(aten.conv1d.default\)"):
        qt.export_executorch(ref, x, tmp_path / "tiny1d.pte")
