"""The text of a saved program is parsed within bounds fixed before parsing
(``quantree.backends.cpu.saved.checks.bounded_text``, ``archive_bounds``).

Each crafted file is a legitimate saved model with one member changed; on c04c399 the
first made ``sympy.sympify`` run for minutes, the second raised a raw ``RecursionError``
(a 20-line traceback from the CLI), the third inflated hundreds of megabytes. Each runs in
a subprocess with a timeout, so a hang is a failure, not a stuck suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from crafted_programs import AddOne, edit_json, example, rewrite

from quantree.tools.cli import EXIT_BAD_INPUT

MODEL = "models/model.json"


@pytest.fixture(scope="module")
def float_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bounded") / "model.pt2"
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(AddOne().eval(), example(), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def _load_in_subprocess(path: Path) -> subprocess.CompletedProcess[str]:
    script = (
        "import sys\nfrom quantree.tools.files import BadFile, load_program\n"
        "try:\n    load_program(sys.argv[1])\nexcept BadFile as e:\n    print('BadFile', e)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )


def _power_tower(program: dict) -> None:
    """The input's batch size (``Symbol('s77', ...)``) plus ``0*9**9**9``."""
    for meta in program["graph_module"]["graph"]["tensor_values"].values():
        for size in meta["sizes"]:
            if "as_expr" in size:
                size["as_expr"]["expr_str"] += " + 0*9**9**9"
                return


def test_a_power_tower_in_a_symbolic_shape_is_refused(float_file: Path, tmp_path: Path) -> None:
    path = rewrite(float_file, tmp_path / "tower.pt2", edit_json(MODEL, _power_tower))
    done = _load_in_subprocess(path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"BadFile {path}: refused") and "symbolic" in done.stdout


def _deep(program: dict) -> None:
    program["graph_module"]["graph"]["custom_obj_values"] = "DEEP"


def test_json_nested_100000_deep_is_one_line_exit_2(float_file: Path, tmp_path: Path) -> None:
    def change(name: str, data: bytes) -> bytes:
        if name != MODEL:
            return data
        program = json.loads(data)
        _deep(program)
        return json.dumps(program).encode().replace(b'"DEEP"', b"[" * 100_000 + b"]" * 100_000)

    path = rewrite(float_file, tmp_path / "deep.pt2", change)
    done = subprocess.run(
        [sys.executable, "-m", "quantree_cli", "inspect", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "JSON nested 10000" in lines[0], done.stderr[-2000:]


def test_a_deflate_bomb_is_refused_before_inflating(float_file: Path, tmp_path: Path) -> None:
    """60 MB of JSON whitespace deflated to 60 KB: under the per-member cap, but parsing it
    would cost gigabytes, past the budget a 100 KB file gets."""
    path = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(float_file) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(MODEL):
                data = data + b" " * (60 << 20)
                dst.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
            else:
                dst.writestr(info, data)
    assert path.stat().st_size < 1 << 20
    done = _load_in_subprocess(path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"BadFile {path}:") and "load budget" in done.stdout
