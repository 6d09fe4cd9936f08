"""C-level check: every kernel path equals the portable path bit for bit (csrc/check).

``kernel_check`` builds random GEMMs (odd sizes, every epilogue, 16-bit operands split in
two planes, weights reaching -128, operands at the ends of their ranges) and random cases of
every other exported kernel (linear, the three convolutions, the int16-weight 1-d one,
matmul, max pooling, softmax, binary, lookup, quantize / dequantize / quantize16, the
recurrent layer in each cell kind with projection, int16 feedback and int16 input, the
whole stacked op padded and packed, a cells-mode program; GEMMs, linears and grouped convs
with 7-bit weights at -63 / 63 on activations at 0 / 255, and GEMMs whose weights are 7-bit
but for one byte), runs them on the portable path,
then on every other path the CPU has, and compares the output bytes. Here it runs
natively (the x86 paths this CPU has), and cross-compiled for aarch64 under ``qemu-aarch64``:
``-cpu max`` (NEON and the dot product) and ``-cpu cortex-a53`` (NEON only). The aarch64 test
needs ``g++-aarch64-linux-gnu`` and ``qemu-user``; it is skipped, saying so, where they are
missing.

The x86 binary is built exactly as the shipped baseline library is (``-march=x86-64``
outside the ISA files, each ISA file with its flags) and also runs under ``qemu-x86_64`` as
older and other x86 CPUs (``X86_MODELS``): each must select the path its features allow
(cpuid, and the OS's XSAVE support: ``Haswell,-xsave``), run without an illegal instruction,
and compute every kernel's bytes, the inexact ones included, equal to this machine's run of
the same path (the printed digests). The x86-64-v3 variant (its code outside the ISA files
compiled for AVX2) runs under an AVX2 model the same way. qemu 7.2's TCG emulates SSE4.2,
AVX, AVX2 and FMA but not AVX-512 or AVX-VNNI (it drops them from every model, with a
warning), so those paths are checked natively only, and their choice from cpuid by
``test_isa_dispatch.py``.

On a CPU with AMX (and an OS that grants it), "path 8" is the AVX-512 VNNI path with every
product of 16 rows and more on the tiles (``qt_amx(2)``: the odd small shapes reach the tiles'
row, column and k tails); its bytes must equal the vector path's for every kernel, the
float-gate ones included (same gate code, exact integer sums).

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

from quantree.backends.cpu.native import build as build_native

CHECK = build_native.CSRC / "check" / "kernel_check.cpp"
CASES = 400
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")
QEMU_X86 = "qemu-x86_64"
X86_CASES = 200
X86_MODELS = {  # qemu -cpu model: the path the library must select there (qt::Isa)
    "Nehalem": 0,  # SSE4.2, before AVX: the portable (SSE2) path
    "SandyBridge": 0,  # AVX without AVX2
    "Haswell": 1,  # AVX2 + FMA, the first x86-64-v3 CPU
    "Skylake-Client": 1,
    "EPYC": 1,  # AMD Zen 1
    "Haswell,-xsave": 0,  # cpuid reports AVX2, but the OS has not enabled the AVX state
    "Haswell,-bmi2": 0,  # AVX2 + FMA without the rest of x86-64-v3 (a VM masking BMI2)
}
FEW_CASES = 24
"""Cases on a model whose path an earlier model already ran with ``X86_CASES`` (the same
binary, the same code on that path): what such a model adds is its own choice of path, and
every kernel of every path up to it run there (24 GEMMs, 6 cases of each other kernel)
with no illegal instruction and the bytes of this machine's run of as many cases. The 200
cases, which the bit-equality of the odd shapes needs, run once per path, not per model."""


def build_check(
    tmp: Path,
    compiler: str,
    march: str,
    isa: dict[str, tuple[str, ...]],
    reuse: tuple[str, ...] = (),
) -> Path:
    """The check driver linked with the library's objects (``reuse``: ISA objects already
    compiled, with the same flags, for another build)."""
    objects = build_native.compile_objects(compiler, tmp, march, isa, more=(CHECK,))
    return build_native.link_program(compiler, [*objects, *reuse], tmp / "kernel_check")


KERNELS = {
    "gemm", "gemm_prepared", "linear", "conv2d", "conv2d_grouped", "conv2d_depthwise", "matmul",
    "max_pool2d", "softmax", "binary", "lookup", "quantize", "dequantize", "quantize16",
    "rnn_lstm", "rnn_gru", "rnn_tanh", "rnn_relu", "cell_loop_tanh", "cell_loop_relu",
    "rnn_stack_lstm", "rnn_stack_relu", "rnn_packed_lstm", "rnn_packed_relu", "conv_transpose",
    "conv_transpose16", "conv1d_w16", "gemm_w7", "gemm_8bit_twin", "linear_w7", "conv2d_w7",
}  # fmt: skip
FLOAT_GATES = {
    "rnn_lstm", "rnn_gru", "rnn_tanh", "cell_loop_tanh", "rnn_stack_lstm", "rnn_packed_lstm",
}  # fmt: skip
PORTABLE = 0  # qt::Isa
AVX2 = 1  # qt::AVX2: the one path with a GEMM of its own for 7-bit weights (Kernels::gemm_w7)
AVX512 = 3  # qt::AVX512VNNI: its vector kernels alone (qt_amx(0))
AMX = 8  # the AVX-512 VNNI path with every product of 16 rows and more on AMX tiles (qt_amx(2))


def check_path(
    path: int, kernels: dict[str, tuple[int, int | None]], report: str, cases: int = CASES
) -> None:
    """The kernels a path reports, each compared with none differing; only a vector path's
    float-gate kernels are inexact, and such a path's gate math is held to its tolerance."""
    expected = KERNELS if path == PORTABLE else KERNELS | {"gate_math"}
    assert set(kernels) == expected, report
    assert kernels["gemm"] == (cases, 0), report
    assert kernels["gemm_prepared"] == (cases, 0), report
    if path != PORTABLE:
        assert kernels["gate_math"] == (cases, 0), report
    for name, (n, bad) in kernels.items():
        inexact_ok = bad is None and name in FLOAT_GATES and path != PORTABLE
        assert n > 0 and (bad == 0 or inexact_ok), report


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


def selected(stdout: str) -> int:
    """The path the library chose by itself (kernel_check's first line)."""
    found = re.search(r"cpu features (\d+) selected path (\d+)", stdout)
    assert found, stdout
    return int(found.group(2))


def digests(stdout: str) -> dict[str, str]:
    """ "reference KERNEL" / "path P KERNEL" -> the digest of its output bytes."""
    return dict(re.findall(r"^(reference \w+|path \d+ \w+) .*digest (\w+)$", stdout, re.M))


def compared(found: dict[int, dict[str, tuple[int, int | None]]]) -> int:
    """How many cases were compared bit for bit, over every path and kernel."""
    return sum(
        c
        for kernels in found.values()
        for name, (c, bad) in kernels.items()
        if bad is not None and name != "gate_math"
    )


@pytest.fixture(scope="module")
def baseline_check(tmp_path_factory) -> Path:
    """kernel_check built as the shipped baseline library is (its objects stay beside it)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    tmp = tmp_path_factory.mktemp("baseline")
    return build_check(tmp, "c++", build_native.PORTABLE_MARCH, build_native.ISA_SOURCES)


def test_native_paths_equal_portable(baseline_check):
    program = baseline_check
    out = subprocess.run([str(program), str(CASES)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    found = results(out.stdout)
    assert found, out.stdout
    for path, kernels in found.items():
        check_path(path, kernels, out.stdout)
    # 7-bit weights (gemm_w7, linear_w7, conv2d_w7, -63 / 63 on 0 / 255) equal the portable
    # bytes above; the weights one byte past them (gemm_8bit_twin) too, and that proves they
    # never reach the AVX2 path's 7-bit GEMM: forced onto them, it gives other bits.
    witness = re.findall(r"path (\d+) w7_gemm_on_8bit_weights differs (\d+) of (\d+)", out.stdout)
    assert {int(p) for p, _, _ in witness} == {AVX2} & set(found), out.stdout
    assert all(int(n) > 0 for _, n, _ in witness), out.stdout
    if AMX in found:  # the tiles' integer sums are exact: the vector path's bytes, every kernel
        got = digests(out.stdout)
        on_tiles = {k.split()[2]: v for k, v in got.items() if k.startswith(f"path {AMX} ")}
        vector = {k.split()[2]: v for k, v in got.items() if k.startswith(f"path {AVX512} ")}
        assert on_tiles and on_tiles == vector, out.stdout


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
    # neon, neondot (qt::Isa); the a53's neon path is the code "max" ran with every case:
    # there it adds its choice of path and a run of every kernel without the dot product
    expected = {"max": ({4, 5}, CASES), "cortex-a53": ({4}, FEW_CASES)}
    for cpu, (paths, cases) in expected.items():
        out = subprocess.run(
            [QEMU, "-cpu", cpu, "-L", str(SYSROOT), str(program), str(cases)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        found = results(out.stdout)
        assert set(found) == paths, (cpu, out.stdout)
        for path, kernels in found.items():
            check_path(path, kernels, f"qemu -cpu {cpu}\n{out.stdout}", cases)
        print(f"qemu -cpu {cpu}: {compared(found)} cases bit-equal to the portable path")


@pytest.mark.skipif(
    not build_native.X86 or shutil.which(QEMU_X86) is None or shutil.which("c++") is None,
    reason=f"needs an x86-64 host with c++ and {QEMU_X86} (apt-get install qemu-user)",
)
def test_baseline_library_on_other_x86_cpus_under_qemu(baseline_check, tmp_path):
    program, base = baseline_check, baseline_check.parent
    expected: dict[str, str] = {}
    for cases in (X86_CASES, FEW_CASES):  # the digests of this machine's run, as many cases
        here = subprocess.run([str(program), str(cases)], capture_output=True, text=True)
        assert here.returncode == 0, here.stdout + here.stderr
        expected |= {f"{cases} {key}": value for key, value in digests(here.stdout).items()}

    def under(cpu: str, binary: Path, cases: int) -> str:
        out = subprocess.run(
            [QEMU_X86, "-cpu", cpu, str(binary), str(cases)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, (cpu, out.returncode, out.stdout, out.stderr[-2000:])
        return out.stdout

    def same_bytes(stdout: str, cases: int) -> bool:
        got = {f"{cases} {key}": value for key, value in digests(stdout).items()}
        return bool(got) and all(expected.get(key, value) == value for key, value in got.items())

    ran_in_full: set[int] = set()  # the paths some model already ran with X86_CASES
    for cpu, path in X86_MODELS.items():
        cases = FEW_CASES if path in ran_in_full else X86_CASES
        ran_in_full.add(path)
        stdout = under(cpu, program, cases)
        assert selected(stdout) == path, (cpu, stdout)
        found = results(stdout)
        assert set(found) == set(range(path + 1)), (cpu, stdout)  # the paths below it too
        for p, kernels in found.items():
            check_path(p, kernels, f"qemu -cpu {cpu}\n{stdout}", cases)
        # the same bytes as here, kernel by kernel, the vector path's inexact ones included
        assert same_bytes(stdout, cases), cpu
        print(f"qemu -cpu {cpu}: path {path}, {compared(found)} cases bit-equal to portable")
    assert ran_in_full == set(X86_MODELS.values())

    # the x86-64-v3 variant: its own portable code, the same ISA objects
    v3 = tmp_path
    isa_objects = tuple(str(base / (Path(s).stem + ".o")) for s in build_native.X86_ISA_SOURCES)
    variant = build_check(v3, "c++", "x86-64-v3", {}, reuse=isa_objects)
    stdout = under("Haswell", variant, X86_CASES)
    assert selected(stdout) == 1, stdout
    for p, kernels in results(stdout).items():
        check_path(p, kernels, f"x86-64-v3 variant, qemu -cpu Haswell\n{stdout}", X86_CASES)
    assert same_bytes(stdout, X86_CASES)


VECTOR_REGISTER = re.compile(r"%[yz]mm\d|%k[0-7]\b|\bv[a-z0-9]+\s+.*%xmm")


@pytest.mark.skipif(
    not build_native.X86 or shutil.which("objdump") is None or shutil.which("nm") is None,
    reason="needs an x86-64 host with binutils (objdump, nm)",
)
def test_no_vector_instruction_outside_the_isa_files(baseline_check):
    """What qemu runs is only the code the cases reach; this reads all of it. In the baseline
    build no object outside the ISA files holds an AVX (VEX / EVEX) instruction, none shares
    an inline function (a COMDAT copy the linker could take from an ISA file) with an ISA
    file, and no ISA file runs code when the library loads (a static initializer)."""
    objects = {path.name: path for path in baseline_check.parent.glob("*.o")}
    isa = {Path(source).stem + ".o" for source in build_native.X86_ISA_SOURCES}
    assert isa <= set(objects)

    def weak(name: str) -> set[str]:
        listing = subprocess.run(
            ["nm", "--defined-only", str(objects[name])], capture_output=True, text=True
        ).stdout
        return {f[2] for f in (line.split() for line in listing.splitlines()) if f[1] in "WVu"}

    shared_with_isa = set().union(*(weak(n) for n in isa))
    for name in sorted(set(objects) - isa):
        code = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", str(objects[name])],
            capture_output=True,
            text=True,
        ).stdout
        vector = [line for line in code.splitlines() if VECTOR_REGISTER.search(line)]
        assert not vector, (name, vector[:5])
        assert not weak(name) & shared_with_isa, (name, sorted(weak(name) & shared_with_isa))
    for name in isa:
        sections = subprocess.run(
            ["objdump", "-h", str(objects[name])], capture_output=True, text=True
        ).stdout
        assert ".init_array" not in sections and ".ctors" not in sections, name
