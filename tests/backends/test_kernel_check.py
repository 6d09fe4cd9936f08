"""C-level check: every kernel path equals the portable path bit for bit (csrc/check).

``kernel_check`` builds random GEMMs (odd sizes, every epilogue, 16-bit operands split in
two planes, weights reaching -128, operands at the ends of their ranges) and random cases of
every other exported kernel (linear, the three convolutions, matmul, max pooling, softmax,
binary, lookup, quantize / dequantize / quantize16, the recurrent layer in each cell kind with
projection, int16 feedback and int16 input, the whole stacked op padded and packed, a
cells-mode program), runs them on the portable
path, then on every other path the CPU has, and compares the output bytes. Here it runs
natively (the x86 paths this CPU has), and cross-compiled for aarch64 under ``qemu-aarch64``:
``-cpu max`` (NEON and the dot product) and ``-cpu cortex-a53`` (NEON only). The aarch64 test
needs ``g++-aarch64-linux-gnu`` and ``qemu-user``; it is skipped, saying so, where they are
missing.

Every vector path (x86 and aarch64) computes sigmoid and tanh with its own polynomial, not
libm's, so the recurrent kernels with float gates (LSTM, GRU, tanh RNN, a cell program with a
float tanh) are reported there as "inexact" and not compared bit for bit; everything else
must match. The gate math itself is checked to a tolerance instead ("gate_math": each path's
cell and activation functions against the portable ones, within 2e-6 + 2e-6 |x| of its
floats and one step of its integers).
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


KERNELS = {
    "gemm", "gemm_prepared", "linear", "conv2d", "conv2d_grouped", "conv2d_depthwise", "matmul",
    "max_pool2d", "softmax", "binary", "lookup", "quantize", "dequantize", "quantize16",
    "rnn_lstm", "rnn_gru", "rnn_tanh", "rnn_relu", "cell_loop_tanh", "cell_loop_relu",
    "rnn_stack_lstm", "rnn_stack_relu", "rnn_packed_lstm", "rnn_packed_relu", "conv_transpose",
}  # fmt: skip
FLOAT_GATES = {
    "rnn_lstm", "rnn_gru", "rnn_tanh", "cell_loop_tanh", "rnn_stack_lstm", "rnn_packed_lstm",
}  # fmt: skip
PORTABLE = 0  # qt::Isa


def check_path(path: int, kernels: dict[str, tuple[int, int | None]], report: str) -> None:
    """The kernels a path reports, each compared with none differing; only a vector path's
    float-gate kernels are inexact, and such a path's gate math is held to its tolerance."""
    expected = KERNELS if path == PORTABLE else KERNELS | {"gate_math"}
    assert set(kernels) == expected, report
    assert kernels["gemm"] == (CASES, 0), report
    assert kernels["gemm_prepared"] == (CASES, 0), report
    if path != PORTABLE:
        assert kernels["gate_math"] == (CASES, 0), report
    for name, (cases, bad) in kernels.items():
        inexact_ok = bad is None and name in FLOAT_GATES and path != PORTABLE
        assert cases > 0 and (bad == 0 or inexact_ok), report


def results(stdout: str) -> dict[int, dict[str, tuple[int, int | None]]]:
    """path -> kernel -> (cases, mismatches), from kernel_check's report; mismatches is None
    where the path's own gate math makes the kernel inexact by design (not compared)."""
    found: dict[int, dict[str, tuple[int, int | None]]] = {}
    for p, name, cases, verdict, n in re.findall(
        r"path (\d+) (\w+) cases (\d+) (mismatches|inexact) (\d+)", stdout
    ):
        bad = int(n) if verdict == "mismatches" else None
        found.setdefault(int(p), {})[name] = (int(cases), bad)
    return found


def compared(found: dict[int, dict[str, tuple[int, int | None]]]) -> int:
    """How many cases were compared bit for bit, over every path and kernel."""
    return sum(
        c
        for kernels in found.values()
        for name, (c, bad) in kernels.items()
        if bad is not None and name != "gate_math"
    )


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++) on PATH")
def test_native_paths_equal_portable(tmp_path):
    program = build_check(tmp_path, "c++", build_native.PORTABLE_MARCH, build_native.ISA_SOURCES)
    out = subprocess.run([str(program), str(CASES)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    found = results(out.stdout)
    assert found, out.stdout
    for path, kernels in found.items():
        check_path(path, kernels, out.stdout)


@pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None or not SYSROOT.is_dir(),
    reason=f"aarch64 cross tools missing ({CROSS} from g++-aarch64-linux-gnu, {QEMU} from "
    "qemu-user): apt-get install g++-aarch64-linux-gnu qemu-user",
)
def test_aarch64_paths_match_portable_under_qemu(tmp_path):
    # the whole library builds for aarch64 ...
    library = build_native.compile_library(
        CROSS, tmp_path / "libquantree_cpu_kernels.so", "armv8-a", build_native.ARM64_ISA_SOURCES
    )
    assert library.stat().st_size > 10_000
    # ... and every kernel on every path is bit-equal to the portable one
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
        for path, kernels in found.items():
            check_path(path, kernels, f"qemu -cpu {cpu}\n{out.stdout}")
        print(f"qemu -cpu {cpu}: {compared(found)} cases bit-equal to the portable path")
