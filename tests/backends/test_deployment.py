"""What a deployment needs: ``import quantree`` then a plain ``torch.export.load``; and a
CPU lowering that cannot run something natively says so."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, save


def _mlp_data() -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    return model, [(torch.randn(3, 8),) for _ in range(4)]


def test_plain_torch_export_load_after_import_quantree(tmp_path) -> None:
    model, data = _mlp_data()
    low = qt.quantize(model, data[0], data, backend=CPU, progress=False)
    path = tmp_path / "mlp.pt2"
    save(low, path, data[0])
    torch.save(data[1], tmp_path / "x.pt")
    expected = low(*data[1])
    code = (
        "import sys, torch, quantree\n"
        f"m = torch.export.load(r'{path}').module()\n"
        f"(x,) = torch.load(r'{tmp_path / 'x.pt'}', weights_only=True)\n"
        "torch.save(m(x), sys.argv[1])\n"
    )
    out = tmp_path / "y.pt"
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.equal(torch.load(out, weights_only=True), expected)


def test_int16_activations_on_cpu_are_named_not_silent() -> None:
    """Before: A16W8Quantizer with backend=CPU came back as the reference graph, silently.
    Its linears now run natively (int16 inputs as two byte planes); the relu between them,
    which has no int16 kernel, is named."""
    model, data = _mlp_data()
    with pytest.warns(qt.QuantreeWarning, match=r"1 op\(s\) compute in float: aten.relu"):
        low = qt.quantize(model, data[0], data, quantizer=qt.A16W8Quantizer(), backend=CPU)
    wide = [n for n in low.graph.nodes if n.target == torch.ops.quantree.linear16.default]
    assert len(wide) == 2


def test_int8_model_on_cpu_lowers_without_that_warning() -> None:
    model, data = _mlp_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        qt.quantize(model, data[0], data, backend=CPU, progress=False)


def test_saved_models_keep_a_dynamic_batch(tmp_path) -> None:
    """Before: quantize with batch 8, call with batch 1 -> 'Guard failed: ...size()[0] == 8'."""
    from quantree.backends import load

    model, data = _mlp_data()
    low = qt.quantize(model, data[0], data, backend=CPU, progress=False)
    save(low, tmp_path / "dyn.pt2", data[0])
    save(low, tmp_path / "static.pt2", data[0], dynamic_batch=False)
    dynamic, static = load(tmp_path / "dyn.pt2"), load(tmp_path / "static.pt2")
    x = torch.randn(9, 8)
    with torch.no_grad():
        assert torch.equal(dynamic(x), low(x))
        assert torch.equal(dynamic(x[:1]), low(x[:1]))
        with pytest.raises(Exception, match="size"):
            static(x)


def test_cli_output_keeps_the_input_programs_dynamic_batch(tmp_path) -> None:
    from quantree.backends import load
    from quantree_cli import main

    model, data = _mlp_data()
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, data[0], dynamic_shapes=({0: batch},))
    torch.export.save(program, tmp_path / "m.pt2")
    torch.save(data, tmp_path / "d.pt")
    common = ["quantize", str(tmp_path / "m.pt2"), "--calibration", str(tmp_path / "d.pt")]
    assert main([*common, "-o", str(tmp_path / "o.pt2"), "--backend", "cpu", "--quiet"]) == 0
    assert load(tmp_path / "o.pt2")(torch.randn(7, 8)).shape == (7, 4)
    pinned = str(tmp_path / "p.pt2")
    assert main([*common, "-o", pinned, "--static-batch", "--quiet"]) == 0
    with pytest.raises(Exception, match="size"):
        load(pinned)(torch.randn(7, 8))
