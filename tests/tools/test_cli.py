"""The CLI: quantize a saved program, inspect it, and refuse bad files in one line."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from torch import nn

import quantree as qt
from quantree.tools.cli import EXIT_BAD_INPUT
from quantree.tools.report import PNG_SIGNATURE, embedded_pngs, embedded_svgs
from quantree_cli import main

from support import batches


class Tagger(nn.Module):
    """A small recurrent model whose state leaves are all read."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(10, 16, 2, batch_first=True)
        self.head = nn.Linear(16, 5)
        self.gate = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(x)
        y = self.head(out) + self.gate(h[-1] + c[-1]).unsqueeze(1)
        return y.cumsum(1)  # no rule quantizes cumsum: it stays in float


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cli")
    model = Tagger().eval()
    data = batches((3, 7, 10), n=12)
    paths = {"model": root / "model.pt2", "data": root / "data.pt", "root": root}
    torch.export.save(torch.export.export(model, data[0]), str(paths["model"]))
    torch.save(data, paths["data"])
    return paths


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _python_api(
    files: dict[str, Path], quantizer: qt.Quantizer | None = None, backend: str = "auto"
):
    """What the Python API gives for the CLI's defaults (``--backend auto``, as qt.quantize)."""
    data = torch.load(files["data"], weights_only=True)
    gm = torch.export.load(str(files["model"])).module()
    prepared = qt.prepare(gm, quantizer or qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    return qt.lower(qt.convert(prepared), backend), data


@pytest.fixture(scope="module")
def python_api(files: dict[str, Path]):
    """``_python_api`` at the CLI's defaults, once for the file: four tests compare the CLI's
    output with it (``lower`` copies what it is given, so the model is read, never changed)."""
    return _python_api(files)


def test_round_trip_matches_python_api_exactly(files: dict[str, Path], python_api, capsys) -> None:
    out = files["root"] / "out.pt2"
    before = (_digest(files["model"]), _digest(files["data"]))
    code = main(
        ["quantize", str(files["model"]), "--calibration", str(files["data"]), "-o", str(out)]
    )
    assert code == 0
    assert f"-> {out}" in capsys.readouterr().out
    assert (_digest(files["model"]), _digest(files["data"])) == before
    loaded = torch.export.load(str(out)).module()
    expected, data = python_api
    with torch.no_grad():
        for (x,) in data[:3] + batches((3, 7, 10), n=2, seed=5):
            assert torch.equal(loaded(x), expected(x))


def test_round_trip_through_a_subprocess(files: dict[str, Path], python_api) -> None:
    out = files["root"] / "out_subprocess.pt2"
    before = _digest(files["model"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "quantree_cli", "quantize", str(files["model"]),
         "--calibration", str(files["data"]), "-o", str(out), "--quiet"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _digest(files["model"]) == before
    loaded = torch.export.load(str(out)).module()
    expected, data = python_api
    with torch.no_grad():
        assert torch.equal(loaded(*data[0]), expected(*data[0]))


def test_inspect_lists_points_and_float_ops(files: dict[str, Path], capsys) -> None:
    out = files["root"] / "inspect.pt2"
    main(["quantize", str(files["model"]), "--calibration", str(files["data"]), "-o", str(out),
          "--backend", "reference", "--quiet"])  # fmt: skip
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "quantized tensors" in text
    for leaf in ("lstm[0]", "lstm[1]", "lstm[2]"):
        assert leaf in text
    assert "per-channel axis 0" in text and "per-tensor scale" in text and "int32" in text
    assert "stay in float: cumsum" in text
    assert main(["inspect", str(files["model"])]) == 0
    assert "no quantize/dequantize ops: the model is float" in capsys.readouterr().out


def test_report_has_decodable_plots(files: dict[str, Path]) -> None:
    out, report = files["root"] / "rep.pt2", files["root"] / "reports" / "r.html"
    code = main(["quantize", str(files["model"]), "--calibration", str(files["data"]),
                 "-o", str(out), "--report", str(report), "--quiet"])  # fmt: skip
    assert code == 0
    page = report.read_text()
    assert "lstm_l1[2]" in page and "What is quantized" in page  # the last layer's c_n
    (steps,) = embedded_svgs(page)  # the LSTM's output SQNR per time step
    assert "SQNR per time step" in steps
    images = embedded_pngs(page)
    assert images and all(png.startswith(PNG_SIGNATURE) for png in images)
    for i, png in enumerate(images):
        path = files["root"] / f"plot{i}.png"
        path.write_bytes(png)
        assert matplotlib.image.imread(path).ndim == 3


def _bad_inputs(files: dict[str, Path]) -> dict[str, list[str]]:
    root = files["root"]
    truncated = root / "truncated.pt2"
    truncated.write_bytes(files["model"].read_bytes()[:5000])
    state_dict = root / "state_dict.pt2"
    torch.save(Tagger().state_dict(), state_dict)
    not_a_list = root / "dict.pt"
    torch.save({"x": torch.zeros(3)}, not_a_list)
    truncated_data = root / "truncated.pt"
    truncated_data.write_bytes(files["data"].read_bytes()[:300])
    wrong_shape = root / "wrong_shape.pt"
    torch.save([(torch.zeros(2, 3),)], wrong_shape)
    text = root / "text.pt"
    text.write_text("hello")
    good = torch.load(files["data"], weights_only=True)[:3]
    later = {  # a bad batch after good ones: caught before it runs, not by a traceback
        "arity": (torch.zeros(3, 7, 10), torch.zeros(1)),
        "shape": (torch.zeros(3, 9, 10),),
        "dtype": (torch.zeros(3, 7, 10, dtype=torch.float64),),
    }
    for name, batch in later.items():
        torch.save([*good, batch], root / f"{name}_later.pt")
    torch.save([(x, torch.zeros(3)) for (x,) in good], root / "pairs.pt")
    model, data, out = str(files["model"]), str(files["data"]), str(root / "o.pt2")

    def calibrating_on(path: Path) -> list[str]:
        return ["quantize", model, "--calibration", str(path), "-o", out]

    return {
        "missing model": ["quantize", str(root / "nope.pt2"), "--calibration", data, "-o", out],
        "truncated model": ["quantize", str(truncated), "--calibration", data, "-o", out],
        "state dict as model": ["quantize", str(state_dict), "--calibration", data, "-o", out],
        "directory as model": ["quantize", str(root), "--calibration", data, "-o", out],
        "missing data": ["quantize", model, "--calibration", str(root / "nope.pt"), "-o", out],
        "truncated data": ["quantize", model, "--calibration", str(truncated_data), "-o", out],
        "dict as data": ["quantize", model, "--calibration", str(not_a_list), "-o", out],
        "program as data": ["quantize", model, "--calibration", model, "-o", out],
        "text as data": ["quantize", model, "--calibration", str(text), "-o", out],
        "data of wrong shape": ["quantize", model, "--calibration", str(wrong_shape), "-o", out],
        "arity in batch 0": calibrating_on(root / "pairs.pt"),
        **{f"{name} in batch 3": calibrating_on(root / f"{name}_later.pt") for name in later},
        "output is the input": ["quantize", model, "--calibration", data, "-o", model],
        "output under a file": ["quantize", model, "--calibration", data, "-o", f"{data}/o.pt2"],
        "report is the input": [
            "quantize",
            model,
            "--calibration",
            data,
            "-o",
            out,
            "--report",
            data,
        ],
        "inspect missing": ["inspect", str(root / "nope.pt2")],
        "inspect truncated": ["inspect", str(truncated)],
        "inspect state dict": ["inspect", str(state_dict)],
    }


def test_bad_files_give_one_line_and_exit_2(files: dict[str, Path], capsys) -> None:
    before = (_digest(files["model"]), _digest(files["data"]))
    for case, argv in _bad_inputs(files).items():
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == EXIT_BAD_INPUT, case
        assert len(err.splitlines()) == 1, (case, err)
        assert err.startswith("quantree: error: "), (case, err)
        assert "Traceback" not in err
    assert (_digest(files["model"]), _digest(files["data"])) == before
    assert not (files["root"] / "o.pt2").exists()


def test_a_bad_batch_is_named_with_its_file_index_and_problem(files: dict[str, Path], capsys):
    cases = _bad_inputs(files)
    expected = {
        "arity in batch 0": r"pairs\.pt: calibration batch 0 has 2 argument\(s\), the program "
        r"takes 1; .*\[\(x,\) for x, _ in loader\]",
        "arity in batch 3": r"arity_later\.pt: calibration batch 3 has 2 argument\(s\), the "
        r"program takes 1",
        "shape in batch 3": r"shape_later\.pt: calibration batch 3 fails the program's shape "
        r"guard x\.size\(\)\[1\] == 7 .*\(3, 9, 10\).*dynamic_shapes=",
        "dtype in batch 3": r"dtype_later\.pt: calibration batch 3 gives x as torch\.float64, "
        r"the program was captured with torch\.float32",
    }
    for case, pattern in expected.items():
        assert main([*cases[case], "--quiet"]) == EXIT_BAD_INPUT, case
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert re.search(pattern, err), (case, err)
    assert not (files["root"] / "o.pt2").exists()


def test_cells_mode_calibrates_on_another_sequence_length(files: dict[str, Path], capsys):
    """Cells-mode graphs have no shape guard: a longer batch is data, not a bad file."""
    argv = _bad_inputs(files)["shape in batch 3"]
    out = files["root"] / "cells_longer.pt2"
    assert main([*argv[:-1], str(out), "--recurrent", "cells", "--quiet"]) == 0
    assert out.exists()
    wrong_features = files["root"] / "features_later.pt"
    good = torch.load(files["data"], weights_only=True)[:2]
    torch.save([*good, (torch.zeros(3, 7, 12),)], wrong_features)
    argv = ["quantize", str(files["model"]), "--calibration", str(wrong_features), "-o",
            str(files["root"] / "o.pt2"), "--recurrent", "cells", "--quiet"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "features_later.pt" in err and "batch 2" in err and "RuntimeError" in err
    assert not (files["root"] / "o.pt2").exists()


def test_bad_file_in_a_subprocess_has_no_traceback(files: dict[str, Path]) -> None:
    argv = _bad_inputs(files)["truncated model"]
    done = subprocess.run(
        [sys.executable, "-m", "quantree_cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_BAD_INPUT
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantree: error: ")
    assert "truncated.pt2" in lines[0]


def test_cells_mode_round_trip(files: dict[str, Path]) -> None:
    out, report = files["root"] / "cells.pt2", files["root"] / "cells.html"
    code = main(["quantize", str(files["model"]), "--calibration", str(files["data"]),
                 "-o", str(out), "--recurrent", "cells", "--quiet", "--backend", "reference",
                 "--report", str(report)])  # fmt: skip
    assert code == 0
    assert ".body/cell" in report.read_text()  # the report shows inside the reference cells
    cells = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    expected, data = _python_api(files, cells, backend="reference")
    loaded = torch.export.load(str(out)).module()
    with torch.no_grad():
        assert torch.equal(loaded(*data[0]), expected(*data[0]))


def test_cpu_backend_round_trip(files: dict[str, Path], python_api, capsys) -> None:
    from quantree.backends import CPU

    out = files["root"] / "cpu.pt2"
    code = main(["quantize", str(files["model"]), "--calibration", str(files["data"]),
                 "-o", str(out), "--backend", "cpu", "--quiet"])  # fmt: skip
    assert code == 0
    expected, data = python_api
    lowered = qt.lower(expected, CPU)
    loaded = torch.export.load(str(out)).module()
    with torch.no_grad():
        assert torch.equal(loaded(*data[0]), lowered(*data[0]))
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the model is float" not in printed and "int8 kernel" in printed
    assert "0 quantization point(s)" not in printed


def test_quantize_under_torchrun_matches_one_process(files: dict[str, Path], python_api) -> None:
    """Two processes each calibrate on half the file; rank 0 writes what one process would."""
    out = files["root"] / "out_torchrun.pt2"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", "-m", "quantree_cli", "quantize"),
            *(str(files["model"]), "--calibration", str(files["data"]), "-o", str(out)),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" -> ") == 1 and "on 2 processes" in done.stdout, done.stdout
    loaded = torch.export.load(str(out)).module()
    expected, data = python_api
    with torch.no_grad():
        for (x,) in data[:3]:
            assert torch.equal(loaded(x), expected(x))
