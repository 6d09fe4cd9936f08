"""The kernels built with the package serve a machine with no compiler; the portable path
warns once at lowering, naming what the CPU lacks.

The prebuilt test copies the package to a temporary directory, builds the library there as
``setup.py`` does (``build_native.compile_library`` into ``_kernels<ext suffix>``), and
lowers and runs a model in a fresh process whose PATH has no compiler and whose extensions
cache is empty. (`pip wheel .` then installing the wheel into a fresh venv does the same
with the real packaging; docs/deployment.md, "Building wheels".)

With ``QUANTREE_QEMU_PYTHON=1`` (slow: Python and torch under qemu-x86_64, 45-90 s per CPU
model), the loader itself runs as other CPUs: with the baseline and x86-64-v3 libraries
prebuilt, a Nehalem must take the baseline one (the v3 one would die of SIGILL there) and the
portable path, a Haswell the v3 one and the AVX2 path, both giving the same bytes.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import quantree
from quantree.backends.cpu.native import build as build_native
from quantree.backends.cpu.native import loader as native

LOWER = """
import warnings, torch, quantree as qt
from torch import nn
from quantree.backends import CPU, cpu_isa
from quantree.backends.cpu.native import loader as native
model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
data = [(torch.randn(2, 8),) for _ in range(3)]
ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    low = qt.lower(ref, CPU)
    low2 = qt.lower(ref, CPU)
    print(tuple(low(torch.randn(2, 8)).shape), tuple(low2(torch.randn(2, 8)).shape))
print("isa", cpu_isa())
print("library", native.library_path())
for w in caught:
    if issubclass(w.category, RuntimeWarning):
        print("WARNING", w.message)
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++) to prebuild with")
def test_prebuilt_library_runs_without_compiler(tmp_path):
    package = tmp_path / "site" / "quantree"
    shutil.copytree(
        Path(quantree.__file__).parent,
        package,
        ignore=shutil.ignore_patterns("__pycache__", "_kernels*", "weights"),
    )
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    cpu = package / "backends" / "cpu" / "native"
    build_native.compile_library("c++", cpu / f"_kernels{suffix}", build_native.PORTABLE_MARCH)
    bare = tmp_path / "bin"  # no compiler on PATH
    bare.mkdir()
    cache = tmp_path / "cache"
    out = run(
        LOWER, PYTHONPATH=str(package.parent), PATH=str(bare), TORCH_EXTENSIONS_DIR=str(cache)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(2, 4) (2, 4)" in out.stdout
    assert f"library {cpu / f'_kernels{suffix}'}" in out.stdout
    assert not cache.exists() or not any(cache.iterdir())  # nothing was compiled

    # sources edited after the build (an editable install): the prebuilt library is not
    # used, and with no compiler that is the usual QuantreeError at lowering
    (cpu / "csrc" / "gemm.cpp").write_text((cpu / "csrc" / "gemm.cpp").read_text() + "\n")
    stale = run(
        LOWER, PYTHONPATH=str(package.parent), PATH=str(bare), TORCH_EXTENSIONS_DIR=str(cache)
    )
    assert stale.returncode != 0 and "compiler" in stale.stderr


def test_portable_path_warns_once_at_lowering():
    out = run(LOWER, QUANTREE_CPU_ISA="portable")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "isa portable" in out.stdout
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out.stdout
    assert "portable kernels" in warnings[0] and "QUANTREE_CPU_ISA=portable" in warnings[0]
    assert "AVX2" in warnings[0]


def test_vector_path_does_not_warn():
    out = run(LOWER)
    assert out.returncode == 0, out.stdout + out.stderr
    if "isa portable" not in out.stdout:
        assert "WARNING" not in out.stdout


def test_portable_warning_names_what_the_cpu_lacks():
    x86 = native.portable_warning(0, arm=False)
    assert "the CPU lacks AVX2, FMA (the avx2 path)" in x86
    assert "AVX-512 VNNI" in x86 and "AVX-VNNI" in x86
    # AVX2 and FMA without the rest of x86-64-v3 (a VM masking BMI2, say): still portable
    partial = native.portable_warning(1 | 2, arm=False)
    assert "the CPU lacks the rest of x86-64-v3 (BMI1, BMI2, F16C, LZCNT, MOVBE)" in partial
    arm = native.portable_warning(0, arm=True)
    assert "ASIMD (NEON)" in arm


QEMU_X86 = shutil.which("qemu-x86_64") or "qemu-x86_64"  # the child's PATH has no tools
CHOOSE = """
import torch
from quantree.backends import cpu_isa
from quantree.backends.cpu.native import loader as native
from quantree.backends.cpu.ops.elementwise import kernels
lib = kernels()
x = torch.arange(-64, 64, dtype=torch.float32) * 0.37
q = torch.empty(128, dtype=torch.int8)
lib.qt_quantize(x.data_ptr(), 128, 1 / 0.1, 3.0, q.data_ptr())
print("library", native.library_path().name)
print("isa", cpu_isa())
print("bytes", bytes(q.numpy()).hex())
"""


@pytest.mark.skipif(
    os.environ.get("QUANTREE_QEMU_PYTHON") != "1"
    or not build_native.X86
    or shutil.which(QEMU_X86) is None
    or shutil.which("c++") is None,
    reason="Python under qemu-x86_64 takes 45-90 s per CPU model: set QUANTREE_QEMU_PYTHON=1 "
    "(needs an x86-64 host, c++ and qemu-user)",
)
def test_loader_takes_the_variant_the_cpu_has_under_qemu(tmp_path):
    package = tmp_path / "site" / "quantree"
    shutil.copytree(
        Path(quantree.__file__).parent,
        package,
        ignore=shutil.ignore_patterns("__pycache__", "_kernels*", "weights"),
    )
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    cpu = package / "backends" / "cpu" / "native"
    build_native.compile_library("c++", cpu / f"_kernels{suffix}", "x86-64")
    build_native.compile_library("c++", cpu / f"_kernels_x86_64_v3{suffix}", "x86-64-v3")
    env = {**os.environ, "PYTHONPATH": str(package.parent), "PATH": str(tmp_path / "bin")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "cache")  # nothing may be compiled
    env.pop("QUANTREE_CPU_ISA", None)
    env.pop("QUANTREE_NATIVE_MARCH", None)
    expected = {"Nehalem": ("_kernels", "portable"), "Haswell": ("_kernels_x86_64_v3", "avx2")}
    outputs = set()
    for model, (stem, isa) in expected.items():
        out = subprocess.run(
            [QEMU_X86, "-cpu", model, sys.executable, "-c", CHOOSE],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, (model, out.stdout, out.stderr[-3000:])
        assert f"library {stem}{suffix}" in out.stdout, (model, out.stdout)
        assert f"isa {isa}" in out.stdout, (model, out.stdout)
        outputs.add(out.stdout.split("bytes ")[1])
    assert len(outputs) == 1  # the same bytes on both
    assert not (tmp_path / "cache").exists()
