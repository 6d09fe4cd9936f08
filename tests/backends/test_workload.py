"""The bundled char-LMs lowered to CPU: same bits per char, a quarter of the bytes, reloadable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus, weights_path

VALIDATION_CHARS = 20_000


@pytest.fixture(scope="module", params=["lstm", "gru"])
def lowered(request, tmp_path_factory) -> dict[str, object]:
    assert weights_path(request.param).is_file(), "the char-LM weights ship with the package"
    model = load_charlm(request.param)
    train = load_corpus("train", max_chars=300_000)
    calib = batches(train, batch_size=32, seq_len=128, n_batches=8, seed=0)
    ref = qt.quantize(model, calib[0], calib, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    path = tmp_path_factory.mktemp("charlm") / "charlm_cpu.pt2"
    save(low, path, calib[0])
    return {"model": model, "ref": ref, "low": low, "path": path, "args": calib[0]}


def test_recurrent_and_head_run_on_native_kernels(lowered):
    targets = {str(n.target) for n in lowered["low"].graph.nodes}  # type: ignore[attr-defined]
    assert {"quantree.rnn.default", "quantree.linear.default"} <= targets
    assert "aten.lstm.input" not in targets and "aten.gru.input" not in targets


def test_bits_per_char_unchanged(lowered):
    val = load_corpus("validation")
    bpc_ref = bits_per_char(lowered["ref"], val, max_chars=VALIDATION_CHARS)  # type: ignore[arg-type]
    bpc_low = bits_per_char(lowered["low"], val, max_chars=VALIDATION_CHARS)  # type: ignore[arg-type]
    assert abs(bpc_low - bpc_ref) <= 0.001 * bpc_ref


def test_saved_model_is_under_three_tenths_of_float(lowered, tmp_path):
    float_path = tmp_path / "float.pt"
    torch.save(lowered["model"].state_dict(), float_path)  # type: ignore[attr-defined]
    saved = Path(lowered["path"]).stat().st_size  # type: ignore[arg-type]
    assert saved <= 0.3 * float_path.stat().st_size


def test_load_round_trip(lowered):
    loaded = load(lowered["path"])  # type: ignore[arg-type]
    tokens = lowered["args"][0]  # type: ignore[index]
    with torch.no_grad():
        assert torch.equal(loaded(tokens), lowered["low"](tokens))  # type: ignore[operator]


def test_loaded_model_runs_in_a_fresh_process(lowered, tmp_path):
    """Only torch and the op registrations: no capture, prepare, convert or lower."""
    tokens, expected = tmp_path / "tokens.pt", tmp_path / "expected.pt"
    torch.save(lowered["args"][0], tokens)  # type: ignore[index]
    with torch.no_grad():
        torch.save(lowered["low"](lowered["args"][0]), expected)  # type: ignore[operator,index]
    script = (
        "import sys, torch\n"
        "import quantree.backends.cpu.ops  # registers torch.ops.quantree.*\n"
        f"m = torch.export.load({str(lowered['path'])!r}).module()\n"
        f"out = m(torch.load({str(tokens)!r}))\n"
        f"sys.exit(0 if torch.equal(out, torch.load({str(expected)!r})) else 1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
