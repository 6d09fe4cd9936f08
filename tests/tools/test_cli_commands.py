"""The command line as wide as the API (issue 24, finding 5): compare and report, a model
given as a factory, the batch a plainly exported program fixes said, and ``--help`` with no
torch import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import quantree as qt
from quantree.tools.cli import EXIT_BAD_INPUT
from quantree_cli import main

from support import batches

FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean(-1))


def build():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(3, 6, 10),)


def not_a_pair():
    return Net()
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("commands")
    (root / "cli_factory_model.py").write_text(textwrap.dedent(FACTORY))
    sys.path.insert(0, str(root))
    try:
        import cli_factory_model
    finally:
        sys.path.remove(str(root))
    model, example = cli_factory_model.build()
    data = batches((3, 6, 10), n=6)
    paths = {"root": root, "model": root / "model.pt2", "data": root / "data.pt"}
    torch.export.save(torch.export.export(model, example), str(paths["model"]))
    torch.save(data, paths["data"])
    paths["factory"] = root / "cli_factory_model.py"
    return paths


def _quantize(files: dict[str, Path], model: str, out: Path, *extra: str) -> int:
    return main(["quantize", model, "--calibration", str(files["data"]), "-o", str(out),
                 "--quiet", *extra])  # fmt: skip


def test_help_and_usage_errors_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from quantree_cli import main\n"
        "for argv in (['--help'], ['compare', '--help'], ['quantize'], ['nonsense']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as done:\n"
        "        print(argv[0], done.code)\n"
        "print('torch imported:', 'torch' in sys.modules, 'quantree' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-4:] == [
        "compare 0",
        "quantize 2",
        "nonsense 2",
        "torch imported: False False",
    ], done.stdout
    assert "usage: quantree" in done.stdout + done.stderr


def test_every_subcommand_has_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "quantree_cli", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    for command in ("demo", "quantize", "inspect", "compare", "report"):
        assert command in done.stdout


def test_compare_prints_rows_worst_first(files: dict[str, Path], capsys) -> None:
    out = files["root"] / "q.pt2"
    assert _quantize(files, str(files["model"]), out, "--backend", "cpu") == 0
    capsys.readouterr()
    code = main(["compare", str(files["model"]), str(out), "--data", str(files["data"]),
                 "--batches", "3"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0
    assert "per-tensor SQNR over 3 batch(es), worst first" in text
    rows = [line.split() for line in text.splitlines()[2:] if line.strip()]
    sqnrs = [float(r[-1]) for r in rows if r[-1] != "exact" and r[-1][0].isdigit()]
    assert sqnrs and sqnrs == sorted(sqnrs)  # worst first
    assert any(r[0] == "output" or r[0].startswith("output") for r in rows), text
    assert min(sqnrs) > 15.0  # a 2-layer int8 model on random data


def test_report_writes_html(files: dict[str, Path], capsys) -> None:
    out = files["root"] / "q_report.pt2"
    assert _quantize(files, str(files["model"]), out) == 0
    page = files["root"] / "reports" / "r.html"
    code = main(["report", str(files["model"]), str(out), "--data", str(files["data"]),
                 "-o", str(page)])  # fmt: skip
    assert code == 0
    html = page.read_text()
    assert "per-tensor SQNR against float" in html and "What is quantized" in html
    assert f"report: {page.resolve()}" in capsys.readouterr().out


def test_a_factory_model_is_captured_with_a_dynamic_batch(files: dict[str, Path], capsys):
    """Given as path.py:function and as module:function, the batch varies, as in the API."""
    out = files["root"] / "from_factory.pt2"
    assert _quantize(files, f"{files['factory']}:build", out) == 0
    assert "exported with every dimension fixed" not in capsys.readouterr().err
    loaded = qt.backends.load(out)
    sys.path.insert(0, str(files["root"]))
    try:
        import cli_factory_model

        model, example = cli_factory_model.build()
        out2 = files["root"] / "from_module.pt2"
        assert _quantize(files, "cli_factory_model:build", out2) == 0
    finally:
        sys.path.remove(str(files["root"]))
    data = torch.load(files["data"], weights_only=True)
    api = qt.quantize(model, example, data, progress=False, backend="reference")
    with torch.no_grad():
        for batch in (1, 3, 7):
            x = torch.randn(batch, 6, 10)
            assert torch.equal(loaded(x), api(x))
            assert torch.equal(qt.backends.load(out2)(x), api(x))


def test_a_plainly_exported_program_fixing_the_batch_is_said(files: dict[str, Path], capsys):
    out = files["root"] / "fixed.pt2"
    assert _quantize(files, str(files["model"]), out) == 0
    err = capsys.readouterr().err
    assert "was exported with every dimension fixed (batch: x at 3)" in err
    assert "module:function" in err and "Dim.AUTO" in err
    assert _quantize(files, str(files["model"]), out, "--static-batch") == 0
    assert "exported with every dimension fixed" not in capsys.readouterr().err
    # following the message: exported with a dynamic batch, no warning and any batch runs
    sys.path.insert(0, str(files["root"]))
    try:
        import cli_factory_model

        model, example = cli_factory_model.build()
    finally:
        sys.path.remove(str(files["root"]))
    dynamic = files["root"] / "dynamic.pt2"
    program = torch.export.export(model, example, dynamic_shapes={"x": {0: torch.export.Dim.AUTO}})
    torch.export.save(program, str(dynamic))
    assert _quantize(files, str(dynamic), out) == 0
    assert "exported with every dimension fixed" not in capsys.readouterr().err
    with torch.no_grad():
        assert qt.backends.load(out)(torch.randn(5, 6, 10)).shape == (5, 4)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
        ("{factory}:missing", "has no function 'missing'"),
        ("{factory}:not_a_pair", "returned a Net; expected module:function returning"),
        ("{root}/absent.py:build", "no such file"),
    ],
)
def test_a_bad_factory_is_one_line_and_exit_2(files, capsys, spec: str, match: str) -> None:
    spec = spec.format(factory=files["factory"], root=files["root"])
    code = _quantize(files, spec, files["root"] / "never.pt2")
    err = capsys.readouterr().err.strip()
    assert code == EXIT_BAD_INPUT and len(err.splitlines()) == 1 and match in err, err
    assert not (files["root"] / "never.pt2").exists()


def test_compare_with_a_factory_float_model(files: dict[str, Path], capsys) -> None:
    out = files["root"] / "q_compare_factory.pt2"
    assert _quantize(files, f"{files['factory']}:build", out, "--backend", "cpu") == 0
    capsys.readouterr()
    assert main(["compare", f"{files['factory']}:build", str(out), "--data",
                 str(files["data"])]) == 0  # fmt: skip
    assert "per-tensor SQNR over 6 batch(es)" in capsys.readouterr().out
