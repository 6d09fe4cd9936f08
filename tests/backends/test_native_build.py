"""The native library's build and load never end a process with a raw error or a signal.

No compiler, a read-only cache, a truncated cached library: lowering raises a
``QuantreeError`` naming the cause and the fix, or the library is rebuilt elsewhere.
Each scenario runs in a fresh process (the library is loaded once per process).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native import loader as native

from support import batches, leaves

LOWER = """
import torch, quantree as qt
from torch import nn
from quantree.backends import CPU, cpu_isa
model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
data = [(torch.randn(2, 8),) for _ in range(3)]
ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
try:
    low = qt.lower(ref, CPU)
except qt.QuantreeError as error:
    print("QuantreeError:", error)
    raise SystemExit(3)
print(cpu_isa(), low(torch.randn(2, 8)).shape)
"""


def run_lowering(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), **env}
    return subprocess.run([sys.executable, "-c", LOWER], env=full, capture_output=True, text=True)


def cached_library(cache: Path) -> Path:
    """The library file the current flags would use in ``cache``."""
    name = native.library_name()
    digest = native.source_digest(os.environ.get("CXX", "c++"))
    return cache / f"{name}_{digest}" / f"{name}.so"


def test_no_compiler_fails_at_lowering(tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    out = run_lowering(tmp_path / "cache", PATH=str(bare), CXX="c++", QUANTREE_NATIVE_PREBUILT="0")
    assert out.returncode == 3, out.stderr
    assert "QuantreeError" in out.stdout and "compiler" in out.stdout and "c++" in out.stdout


def test_truncated_cached_library_is_rebuilt(tmp_path):
    """A library cut short (a build killed mid-copy, a full disk) is never dlopen'ed."""
    target = cached_library(tmp_path)
    target.parent.mkdir(parents=True)
    shutil.copyfile(native.build(native.library_name()), target)
    with target.open("r+b") as f:
        f.truncate(target.stat().st_size // 3)
    out = run_lowering(tmp_path, QUANTREE_NATIVE_PREBUILT="0")  # the runtime build's cache
    assert out.returncode == 0, out.stdout + out.stderr
    assert native.intact(target)


def test_read_only_cache_builds_elsewhere(tmp_path, monkeypatch):
    """An unwritable cache holding a damaged library: built into a temporary directory."""
    target = cached_library(tmp_path)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF truncated")
    real_mkdtemp = tempfile.mkdtemp

    def read_only(*args, **kwargs):  # as on an EROFS mount (chmod does not stop root)
        if kwargs.get("dir") is not None:
            raise OSError(errno.EROFS, "Read-only file system", kwargs["dir"])
        return real_mkdtemp(*args, **kwargs)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native.tempfile, "mkdtemp", read_only)
    path = native.build(native.library_name())
    assert tmp_path not in path.parents and path.stat().st_size > 10_000
    assert target.read_bytes() == b"\x7fELF truncated"


@pytest.mark.parametrize(
    "make",
    [lambda: nn.LSTM(6, 10, 2), lambda: nn.GRU(6, 7, bidirectional=True), lambda: nn.RNN(6, 5)],
    ids=["lstm", "gru", "rnn"],
)
@pytest.mark.parametrize("mode", [qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS])
def test_batch_zero_gives_empty_outputs(make, mode):
    """A dynamic batch of 0 gives what float gives: empty outputs, no signal."""
    torch.manual_seed(0)
    model = make().eval()
    data = batches((4, 3, 6), n=3)
    quantizer = qt.Int8Quantizer(recurrent=mode)
    dynamic = ({1: torch.export.Dim("batch", min=0, max=64)},)
    ref = qt.quantize(model, data[0], data, quantizer=quantizer, progress=False,
                      dynamic_shapes=dynamic, backend="reference")  # fmt: skip
    low = qt.lower(ref, CPU)
    x = torch.randn(4, 0, 6)
    with torch.no_grad():
        want, got = model(x), low(x)
    for w, g in zip(leaves(want), leaves(got), strict=True):
        assert w.shape == g.shape and g.numel() == 0


def test_empty_inputs_of_conv_and_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 5), nn.Softmax(-1)).eval()  # fmt: skip
    data = batches((2, 3, 8, 8), n=3)
    dynamic = ({0: torch.export.Dim("batch", min=0, max=64)},)
    low = qt.lower(
        qt.quantize(
            model, data[0], data, progress=False, dynamic_shapes=dynamic, backend="reference"
        ),
        CPU,
    )
    with torch.no_grad():
        assert low(torch.randn(0, 3, 8, 8)).shape == model(torch.randn(0, 3, 8, 8)).shape
