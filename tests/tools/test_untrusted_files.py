"""Crafted files never run code: every .pt2 and calibration file is read without unpickling.

Each crafted archive is a legitimate ``torch.export.save`` file with one member changed so
that loading it the unsafe way would create a marker file. quantree must refuse it in one
line (exit status 2 from the CLI), create no marker and not print torch's advice to retry
with ``weights_only=False``.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.tools.cli import EXIT_BAD_INPUT
from quantree.tools.files import BadFile, load_program
from quantree_cli import main

from support import batches


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + self.offset


class Touch:
    """Unpickling this opens (creates) ``marker`` for writing: code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str, str]]:
        return builtins.open, (self.marker, "w")


def evil_pickle(marker: Path, protocol: int = 2) -> bytes:
    return pickle.dumps(Touch(marker), protocol=protocol)


@pytest.fixture(scope="module")
def legit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("untrusted")
    model = Small().eval()
    data = batches((3, 6), n=4)
    paths = {"root": root, "model": root / "model.pt2", "data": root / "data.pt"}
    torch.export.save(torch.export.export(model, data[0]), str(paths["model"]))
    torch.save(data, paths["data"])
    return paths


def rewrite(source: Path, target: Path, change: Callable[[str, bytes], bytes | None], add=()):
    """Copy the zip ``source`` to ``target``; ``change(name, data)`` gives new data or None
    to drop the member (names without the archive's root folder); ``add`` adds members."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        root = src.namelist()[0].split("/", 1)[0]
        for info in src.infolist():
            data = change(info.filename.split("/", 1)[1], src.read(info))
            if data is not None:
                dst.writestr(info.filename, data)
        for name, data in add:
            dst.writestr(f"{root}/{name}", data)
    return target


def _keep(name: str, data: bytes) -> bytes:
    return data


def _config_with(entry: dict, name: str) -> Callable[[str, bytes], bytes]:
    def change(member: str, data: bytes) -> bytes:
        if member == "data/constants/model_constants_config.json":
            config = json.loads(data)
            meta = {"is_param": False, "use_pickle": True, "tensor_meta": None, **entry}
            config["config"]["evil"] = {"path_name": name, **meta}
            return json.dumps(config).encode()
        return data

    return change


def _model_json(edit: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    def change(member: str, data: bytes) -> bytes:
        if member == "models/model.json":
            program = json.loads(data)
            edit(program)
            return json.dumps(program).encode()
        return data

    return change


def _guard(program: dict, code: str) -> None:
    program["guards_code"] = [code]


def crafted(legit: dict[str, Path], marker: Path) -> dict[str, Path]:
    """name -> a crafted archive that creates ``marker`` if loaded unsafely."""
    root, model, bomb = legit["root"], legit["model"], evil_pickle(marker)
    opener = f"open({str(marker)!r}, 'w')"
    return {
        "example inputs": rewrite(
            model,
            root / "inputs.pt2",
            lambda m, d: bomb if m == "data/sample_inputs/model.pt" else d,
        ),
        "pickled tensor constant": rewrite(
            model,
            root / "constant.pt2",
            _config_with({}, "tensor_0"),
            add=[("data/constants/tensor_0", bomb)],
        ),
        "pickled object constant": rewrite(
            model,
            root / "opaque.pt2",
            _config_with({}, "opaque_obj_0"),
            add=[("data/constants/opaque_obj_0", bomb)],
        ),
        "pickled weight": rewrite(
            model,
            root / "weight.pt2",
            lambda m, d: (
                d.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
                if m.endswith("weights_config.json")
                else (bomb if m == "data/weights/weight_0" else d)
            ),
        ),
        "legacy weights file": rewrite(
            model, root / "legacy.pt2", _keep, add=[("data/weights/model.pt", bomb)]
        ),
        "unexpected member": rewrite(model, root / "extra.pt2", _keep, add=[("evil.pkl", bomb)]),
        "aoti library": rewrite(
            model, root / "aoti.pt2", _keep, add=[("data/aotinductor/model/model.so", b"\x7fELF")]
        ),
        "guard code": rewrite(
            model, root / "guard.pt2", _model_json(lambda p: _guard(p, f"{opener} is None"))
        ),
        "sympy expression": rewrite(
            model, root / "sympy.pt2", _model_json(lambda p: _sym_value(p, opener))
        ),
        "corrupted member": rewrite(
            model,
            root / "corrupt.pt2",
            lambda m, d: b"{not json" if m == "models/model.json" else d,
        ),
    }


def _sym_value(program: dict, expr: str) -> None:
    """A symbolic size torch parses with sympy.sympify, which evaluates the string."""
    values = program["graph_module"]["graph"].setdefault("sym_int_values", {})
    values["evil"] = {"as_expr": {"expr_str": expr, "hint": None}}


def test_crafted_example_inputs_really_run_code_with_plain_torch(legit, tmp_path) -> None:
    """The threat is real: torch.export.load falls back to full unpickling for these."""
    marker = tmp_path / "ran"
    path = crafted(legit, marker)["example inputs"]
    code = f"import torch; torch.export.load({str(path)!r})"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert marker.exists()


def test_crafted_programs_are_refused_by_every_loader(legit, tmp_path, capsys) -> None:
    from quantree.backends import load

    marker = tmp_path / "ran"
    for case, path in crafted(legit, marker).items():
        for argv in (["inspect", str(path)],
                     ["quantize", str(path), "--calibration", str(legit["data"]),
                      "-o", str(tmp_path / "out.pt2"), "--quiet"]):  # fmt: skip
            assert main(argv) == EXIT_BAD_INPUT, case
            captured = capsys.readouterr()
            err = captured.err.strip()
            assert len(err.splitlines()) == 1, (case, err)
            assert err.startswith(f"quantree: error: {path}"), (case, err)
            assert "weights_only=False" not in captured.err + captured.out, case
        with pytest.raises(BadFile, match=str(path)):
            load(path)
        assert not marker.exists(), case
        assert not (tmp_path / "out.pt2").exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None


def test_refusals_name_the_member_and_say_why(legit, tmp_path) -> None:
    files = crafted(legit, tmp_path / "ran")
    expected = {
        "example inputs": "data/sample_inputs/model.pt",
        "pickled tensor constant": "data/constants/tensor_0",
        "pickled object constant": "data/constants/opaque_obj_0",
        "pickled weight": "data/weights/weight_0",
        "legacy weights file": "data/weights/model.pt",
        "unexpected member": "evil.pkl",
        "aoti library": "data/aotinductor/",
        "guard code": "input guard",
        "sympy expression": "symbolic expression",
    }
    for case, member in expected.items():
        with pytest.raises(BadFile) as info:
            load_program(files[case])
        message = str(info.value)
        assert member in message and "\n" not in message, (case, message)
        if case not in ("guard code", "sympy expression"):
            assert "never unpickles" in message, message


def test_crafted_file_in_a_subprocess_prints_one_line(legit, tmp_path) -> None:
    marker = tmp_path / "ran"
    path = crafted(legit, marker)["example inputs"]
    done = subprocess.run(
        [sys.executable, "-m", "quantree_cli", "inspect", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == EXIT_BAD_INPUT
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantree: error: "), done.stderr
    assert "weights_only" not in done.stderr.replace("weights_only=True", "")
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4])
def test_pickled_calibration_file_is_refused(legit, tmp_path, capsys, protocol) -> None:
    marker = tmp_path / "ran"
    data = tmp_path / "calibration.pt"
    data.write_bytes(evil_pickle(marker, protocol))
    argv = ["quantize", str(legit["model"]), "--calibration", str(data),
            "-o", str(tmp_path / "out.pt2"), "--quiet"]  # fmt: skip
    assert main(argv) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and str(data) in err and "never unpickles" in err, err
    assert "weights_only=False" not in captured.err + captured.out
    assert not marker.exists()
    done = subprocess.run(
        [sys.executable, "-m", "quantree_cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == EXIT_BAD_INPUT
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantree: error: "), done.stderr
    assert not marker.exists()


def test_legit_files_still_round_trip(legit, tmp_path, capsys) -> None:
    from quantree.backends import CPU, load, save

    data = torch.load(legit["data"], weights_only=True)
    prepared = qt.prepare(load_program(legit["model"]).module(), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    reference = qt.convert(prepared)
    ref_path, cpu_path = tmp_path / "ref.pt2", tmp_path / "cpu.pt2"
    torch.export.save(torch.export.export(reference, data[0]), str(ref_path))
    lowered = qt.lower(reference, CPU)
    save(lowered, cpu_path, data[0])
    with torch.no_grad():
        assert torch.equal(load_program(ref_path).module()(*data[1]), reference(*data[1]))
        assert torch.equal(load(cpu_path)(*data[1]), lowered(*data[1]))
    for path in (ref_path, cpu_path):
        assert main(["inspect", str(path)]) == 0
    out = tmp_path / "cli.pt2"
    argv = ["quantize", str(legit["model"]), "--calibration", str(legit["data"]),
            "-o", str(out), "--backend", "cpu", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert main(["inspect", str(out)]) == 0
    assert "weights_only" not in capsys.readouterr().err


def test_a_dynamic_shape_program_with_guards_still_loads(tmp_path) -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (x[:, :4] + y).sum(0)

    batch = torch.export.Dim("batch", min=2, max=64)
    args = (torch.randn(4, 6), torch.randn(4, 4))
    program = torch.export.export(Pair(), args, dynamic_shapes=({0: batch}, {0: batch}))
    path = tmp_path / "dynamic.pt2"
    torch.export.save(program, str(path))
    loaded = load_program(path).module()
    assert torch.equal(loaded(torch.ones(5, 6), torch.ones(5, 4)), torch.full((4,), 10.0))


class Twice(nn.Module):
    """One linear called on two grids: its two offsets and scales are saved as recipes (a
    layer called once, or one this narrow, stores them as they are, which is smaller)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


@pytest.fixture(scope="module")
def lowered_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved CPU-lowered model whose linear offsets and scales are recipes."""
    from quantree.backends import CPU, save

    torch.manual_seed(0)
    model = Twice().eval()
    data = batches((3, 64), n=4)
    low = qt.quantize(model, data[0], data, backend=CPU, progress=False)
    path = tmp_path_factory.mktemp("lowered") / "low.pt2"
    save(low, path, data[0])
    return path


def _recipe_arg(edit: Callable[[dict, dict], None]) -> Callable[[str, bytes], bytes]:
    """Change the arguments of the file's first ``quantree.derived_offset`` node."""

    def change_program(program: dict) -> None:
        graph = program["graph_module"]["graph"]
        node = next(n for n in graph["nodes"] if "derived_offset" in n["target"])
        edit(node, graph)

    return _model_json(change_program)


def _argument(node: dict, name: str) -> dict:
    return next(i for i in node["inputs"] if i["name"] == name)


def _row_sums_from_packed_weight(node: dict, graph: dict) -> None:
    linear = next(n for n in graph["nodes"] if n["target"].endswith("quantree.linear.default"))
    _argument(node, "row_sums")["arg"] = _argument(linear, "weight")["arg"]


def _bias_from_input(node: dict, graph: dict) -> None:
    _argument(node, "bias")["arg"] = {
        "as_tensor": {"name": graph["inputs"][-1]["as_tensor"]["name"]}
    }


def test_recipes_that_do_not_fit_are_refused_in_one_line(lowered_file, tmp_path) -> None:
    from quantree.backends import load

    assert load(lowered_file) is not None
    cases = {
        "row sums of another shape": _recipe_arg(_row_sums_from_packed_weight),
        "a bias that is an input": _recipe_arg(_bias_from_input),
    }
    for case, change in cases.items():
        path = rewrite(lowered_file, tmp_path / f"{len(case)}.pt2", change)
        with pytest.raises(BadFile, match=r"derived_offset") as caught:
            load(path)
        assert str(caught.value).startswith(str(path)), case
        assert len(str(caught.value).splitlines()) == 1, case
        assert main(["inspect", str(path)]) == EXIT_BAD_INPUT, case


def _node_arg(target: str, name: str, value: dict) -> Callable[[str, bytes], bytes]:
    """Set argument ``name`` of the file's first node calling ``target`` to ``value``."""

    def change_program(program: dict) -> None:
        graph = program["graph_module"]["graph"]
        node = next(n for n in graph["nodes"] if target in n["target"])
        _argument(node, name)["arg"] = value

    return _model_json(change_program)


def _filled_terabyte(program: dict) -> None:
    """The file's weight scales (a ``widened`` call) made a ``filled`` constant of 1 TB."""
    node = next(n for n in program["graph_module"]["graph"]["nodes"] if "widened" in n["target"])
    node["target"] = "torch.ops.quantree.filled.default"
    node["inputs"] = [
        {"name": "value", "arg": {"as_float": 1.0}, "kind": 1},
        {"name": "size", "arg": {"as_ints": [1 << 20, 1 << 20]}, "kind": 1},
        {"name": "dtype", "arg": {"as_scalar_type": 7}, "kind": 1},
    ]


def test_derived_row_sums_and_tables_that_do_not_fit_are_refused(lowered_file, tmp_path) -> None:
    """The recipes added for row sums, tables and narrowed constants check their arguments
    as ``derived_offset`` does: a crafted file is a one-line ``BadFile`` naming the op (a
    power of two no float16 scale needs; a filled constant of a terabyte, not allocated)."""
    from quantree.backends import load

    cases = {
        "derived_row_sums": _node_arg("derived_row_sums", "groups", {"as_int": 3}),
        "derived_row_sums ": _node_arg("derived_row_sums", "rows", {"as_int": 1 << 20}),
        "widened": _node_arg("widened", "exponent", {"as_int": 1000}),
        "filled": _model_json(_filled_terabyte),
    }
    for op, change in cases.items():
        path = rewrite(lowered_file, tmp_path / f"{len(op)}.pt2", change)
        with pytest.raises(BadFile, match=op.strip()) as caught:
            load(path)
        assert str(caught.value).startswith(str(path)), op
        assert len(str(caught.value).splitlines()) == 1, op


def test_only_json_members_may_be_deflated(lowered_file, tmp_path, monkeypatch) -> None:
    from quantree.backends import load
    from quantree.backends.cpu.saved import archive

    deflated_weight = tmp_path / "deflated_weight.pt2"
    with zipfile.ZipFile(lowered_file) as src, zipfile.ZipFile(deflated_weight, "w") as dst:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/weights/weight_" in info.filename else None
            dst.writestr(info.filename, src.read(info), compress_type=method or info.compress_type)
    with pytest.raises(BadFile, match="compressed with method 8"):
        load(deflated_weight)
    monkeypatch.setattr(archive, "MAX_INFLATED_JSON", 100)  # the model's JSON is larger
    with pytest.raises(BadFile, match="once inflated"):
        load(lowered_file)
