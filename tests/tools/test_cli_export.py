"""``quantree export --executorch``: a quantized .pt2 written as an ExecuTorch program."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

pytest.importorskip(
    "executorch.exir", reason="ExecuTorch tests need executorch (see docs/deployment-executorch.md)"
)

import quantree as qt
from quantree.backends.executorch import run_executorch
from quantree.tools.cli import EXIT_BAD_INPUT
from quantree.tools.files import load_program
from quantree_cli import main

from support import batches

SQNR_VS_REFERENCE_DB = 30.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).relu().flatten(1))


def test_quantize_then_export_runs_close_to_the_reference(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    data = batches((1, 3, 8, 8), n=6)
    model, calib, quantized = tmp_path / "m.pt2", tmp_path / "d.pt", tmp_path / "q.pt2"
    torch.export.save(torch.export.export(Net().eval(), data[0]), str(model))
    torch.save(data, calib)
    argv = ["quantize", str(model), "--calibration", str(calib), "-o", str(quantized)]
    pte = tmp_path / "model.pte"
    export = ["export", str(quantized), "--executorch", str(pte), "--example", str(calib)]
    # The default (--backend auto) saves the CPU kernels; export says how to get the reference.
    assert main([*argv, "--quiet", "--static-batch"]) == 0
    assert main(export) != 0
    assert "quantree quantize ... --backend reference" in capsys.readouterr().err
    assert not pte.exists()
    # Following the message:
    assert main([*argv, "--quiet", "--static-batch", "--backend", "reference"]) == 0
    code = main(export)
    assert code == 0, capsys.readouterr().err
    assert "XNNPACK calls" in capsys.readouterr().out
    reference = load_program(quantized).module()
    for (x,) in batches((1, 3, 8, 8), n=2, seed=3):
        (got,) = run_executorch(pte, (x,))
        assert qt.sqnr(tree_leaves(reference(x))[0], got) >= SQNR_VS_REFERENCE_DB


def test_export_of_a_missing_file_is_one_line(tmp_path: Path, capsys) -> None:
    code = main(["export", str(tmp_path / "none.pt2"), "--executorch", str(tmp_path / "m.pte")])
    assert code == EXIT_BAD_INPUT
    assert "no such file" in capsys.readouterr().err
