"""C-level check: every GEMM path equals the portable path bit for bit (csrc/check).

``kernel_check`` builds random GEMMs (odd sizes, every epilogue, 16-bit operands split in
two planes, weights reaching -128, operands at the ends of their ranges), runs them on the
portable path, then on every other path the CPU has, and compares the output bytes. Here it
runs natively (the x86 paths this CPU has), and cross-compiled for aarch64 under
``qemu-aarch64``: ``-cpu max`` (NEON and the dot product) and ``-cpu cortex-a53`` (NEON
only). The aarch64 test needs ``g++-aarch64-linux-gnu`` and ``qemu-user``; it is skipped,
saying so, where they are missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from quantree.backends.cpu import build_native

CHECK = build_native.CSRC / "check" / "kernel_check.cpp"
CASES = 400
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")


def build_check(tmp: Path, compiler: str, march: str, isa: dict[str, tuple[str, ...]]) -> Path:
    objects = build_native.compile_objects(compiler, tmp, march, isa, more=(CHECK,))
    return build_native.link_program(compiler, objects, tmp / "kernel_check")


def results(stdout: str) -> dict[int, tuple[int, int]]:
    """path -> (cases, mismatches), from kernel_check's report."""
    found = re.findall(r"path (\d+) cases (\d+) mismatches (\d+)", stdout)
    return {int(p): (int(c), int(m)) for p, c, m in found}


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++) on PATH")
def test_native_paths_equal_portable(tmp_path):
    program = build_check(tmp_path, "c++", build_native.PORTABLE_MARCH, build_native.ISA_SOURCES)
    out = subprocess.run([str(program), str(CASES)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    found = results(out.stdout)
    assert all(bad == 0 and cases == CASES for cases, bad in found.values()), out.stdout


@pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None or not SYSROOT.is_dir(),
    reason=f"aarch64 cross tools missing ({CROSS} from g++-aarch64-linux-gnu, {QEMU} from "
    "qemu-user): apt-get install g++-aarch64-linux-gnu qemu-user",
)
def test_aarch64_paths_equal_portable_under_qemu(tmp_path):
    # the whole library builds for aarch64 ...
    library = build_native.compile_library(
        CROSS, tmp_path / "libquantree_cpu_kernels.so", "armv8-a", build_native.ARM64_ISA_SOURCES
    )
    assert library.stat().st_size > 10_000
    # ... and every GEMM path is bit-equal to the portable one
    check = tmp_path / "check"
    check.mkdir()
    program = build_check(check, CROSS, "armv8-a", build_native.ARM64_ISA_SOURCES)
    expected = {"max": {4, 5}, "cortex-a53": {4}}  # neon, neondot (qt::Isa)
    for cpu, paths in expected.items():
        out = subprocess.run(
            [QEMU, "-cpu", cpu, "-L", str(SYSROOT), str(program), str(CASES)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        found = results(out.stdout)
        assert set(found) == paths, (cpu, out.stdout)
        assert all(r == (CASES, 0) for r in found.values()), (cpu, out.stdout)
