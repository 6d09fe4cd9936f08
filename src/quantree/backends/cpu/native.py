"""Build (once, cached), check and load quantree's C++ int8 kernels.

The kernels are plain C functions with no torch headers, called through ``ctypes`` with
tensor data pointers (no pybind11: about a microsecond per call). They are compiled with the
system's C++ compiler (``$CXX``, default ``c++``) into torch's extensions directory, keyed by
a hash of sources, flags and compiler, and reused until those change.

One library holds every kernel path: the portable code (``-march=$QUANTREE_NATIVE_MARCH``,
default ``native``) plus one file per x86 instruction set compiled with that set's own flags.
The path is chosen when the library loads, from what the CPU reports (``cpu_isa()`` says
which), capped by ``QUANTREE_NATIVE_MARCH`` (``x86-64-v3``: the AVX2 path on any CPU that has
it) or ``QUANTREE_CPU_ISA`` (a path name, for tests).

A cached library is loaded only after its size and SHA-256 match the sidecar written (last,
atomically) by the build that made it: a truncated file would otherwise kill the process
with SIGBUS inside ``dlopen``. A damaged or unwritable cache means a rebuild into a fresh
temporary directory. Any failure to build or load raises ``QuantreeError`` naming the cause
and the fix; lowering for the CPU backend calls ``library()``, so it fails there, not at the
first inference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from quantree.core.errors import QuantreeError

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("gemm.cpp", "layers.cpp", "rnn.cpp", "cells.cpp", "pool.cpp")
HEADERS = ("qt_kernels.h", "qt_vmath.h", "qt_x86_256.h", "gemm_vnni256.h")
X86 = platform.machine().lower() in ("x86_64", "amd64")
ISA_SOURCES: dict[str, tuple[str, ...]] = (
    {
        "isa_avx512.cpp": ("-march=x86-64-v4", "-mavx512vnni"),
        "isa_avxvnni.cpp": ("-march=x86-64-v3", "-mavxvnni"),
        "isa_avx2.cpp": ("-march=x86-64-v3",),
    }
    if X86
    else {}
)
"""Per instruction set: its file and the flags it alone is compiled with."""
CHANNELS_LAST = torch.channels_last
MARCH = os.environ.get("QUANTREE_NATIVE_MARCH", "native")
"""``-march`` of the portable code, and a cap on the path: see ``ISA_CAP``."""
FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-fPIC", f"-I{CSRC}")
ISA_NAMES = ("portable", "avx2", "avxvnni", "avx512vnni")
"""The kernel paths, by the number ``qt_select_isa`` takes and returns (``qt::Isa``)."""
ISA_CAP = {"x86-64": 0, "x86-64-v2": 0, "x86-64-v3": 1, "x86-64-v4": 1}
"""``QUANTREE_NATIVE_MARCH`` values that cap the path (v4 has no VNNI); others do not."""

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES: dict[str, list[type]] = {
    "qt_linear": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _f32,
                  _int],
    "qt_conv2d": [_ptr, *[_i64] * 17, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _f32, _int],
    "qt_conv2d_grouped": [_ptr, *[_i64] * 18, *[_ptr] * 6, _f32, _f32, _int],
    "qt_conv2d_depthwise": [_ptr, *[_i64] * 15, *[_ptr] * 6, _f32, _f32, _int],
    "qt_softmax": [_ptr, _i64, _i64, _ptr, _f32, _f32, _ptr],
    "qt_max_pool2d": [_ptr, *[_i64] * 14, _ptr],
    "qt_quantize16": [_ptr, _i64, _f32, _ptr],
    "qt_binary": [_int, _ptr, _ptr, _i64, _f32, _f32, _f32, _f32, _f32, _f32, _ptr],
    "qt_lookup": [_ptr, _i64, _ptr, _ptr],
    "qt_matmul": [_ptr, _ptr, _i64, _i64, _i64, _i64, _f32, _f32, _f32, _ptr, _ptr, _f32, _f32],
    "qt_quantize": [_ptr, _i64, _f32, _f32, _ptr],
    "qt_dequantize": [_ptr, _i64, _f32, _f32, _ptr],
    "qt_cell_loop": [_ptr, _ptr, _i64, _int, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr,
                     _i64, _ptr],
    "qt_rnn_layer": [_int, _i64, _i64, _i64, _i64, _int, _ptr, _f32, _f32, _ptr, _i64, _ptr,
                     _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _f32, _f32, _f32, _f32, _int,
                     _ptr, _i64, _f32, _f32, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr],
}  # fmt: skip


def isa_cap() -> int:
    """The best path allowed by the environment (``QUANTREE_CPU_ISA``, then the march)."""
    forced = os.environ.get("QUANTREE_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in ISA_NAMES:
            raise QuantreeError(
                f"QUANTREE_CPU_ISA={forced!r} is not a kernel path; use one of "
                f"{', '.join(ISA_NAMES)} (or unset it for the best the CPU supports)"
            )
        return ISA_NAMES.index(forced)
    return ISA_CAP.get(MARCH, len(ISA_NAMES) - 1)


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels, built on first use, with the path for this CPU selected.

    Raises ``QuantreeError`` (cause and fix in the message) when they cannot be built or
    loaded.
    """
    path = build(library_name())
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise QuantreeError(
            f"quantree's CPU kernels at {path} do not load: {error}. Delete that directory "
            "(it is rebuilt on the next use), or point TORCH_EXTENSIONS_DIR elsewhere."
        ) from error
    for symbol, argtypes in SIGNATURES.items():
        fn = getattr(lib, symbol)
        fn.argtypes = argtypes
        fn.restype = None
    lib.qt_select_isa.argtypes = [_int]
    lib.qt_select_isa.restype = _int
    lib.qt_current_isa.restype = _int
    lib.qt_select_isa(isa_cap())
    return lib


def cpu_isa() -> str:
    """The kernel path this process runs: ``avx512vnni``, ``avxvnni``, ``avx2`` or
    ``portable`` (the best the CPU reports, capped by ``QUANTREE_NATIVE_MARCH``)."""
    return ISA_NAMES[library().qt_current_isa()]


def library_name() -> str:
    """The library's file stem; the march is part of it, so builds never overwrite others."""
    suffix = "" if MARCH == "native" else "_" + MARCH.replace("-", "_").replace(".", "_")
    return "quantree_cpu_kernels" + suffix


def source_digest(compiler: str) -> str:
    """A hash of everything the build reads: sources, headers, flags and the compiler."""
    digest = hashlib.sha256(repr((FLAGS, MARCH, ISA_SOURCES, compiler)).encode())
    for source in (*SOURCES, *ISA_SOURCES, *HEADERS):
        digest.update((CSRC / source).read_bytes())
    return digest.hexdigest()[:16]


def file_digest(path: Path) -> str:
    """``<size> <sha256>`` of a file, as its sidecar records it."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def intact(target: Path) -> bool:
    """Whether ``target`` is a library a build finished: its sidecar matches its bytes."""
    sidecar = target.with_suffix(".sha256")
    try:
        return sidecar.read_text().strip() == file_digest(target)
    except OSError:
        return False


def build(name: str) -> Path:
    """The path of an intact built library: from the cache, or compiled now.

    The cache directory is ``$TORCH_EXTENSIONS_DIR`` (or torch's default) /
    ``<name>_<digest>``. When it holds no intact library (missing, truncated, a build that
    died), the library is compiled into a fresh directory and moved into place; when the
    cache is not writable, it is compiled into a temporary directory used by this process
    only.
    """
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise QuantreeError(
            f"quantree's CPU backend needs its native kernels, and building them needs a C++ "
            f"compiler: {compiler!r} (from $CXX, default c++) is not on PATH. Install one "
            "(e.g. apt-get install g++), set CXX to it, or install quantree from a wheel, "
            "which ships the kernels built."
        )
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    root = Path(cache) / f"{name}_{source_digest(compiler)}"
    target = root / f"{name}.so"
    if intact(target):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
    except OSError:  # read-only or otherwise unusable cache: build for this process only
        work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        return compile_library(compiler, work / target.name)
    built = compile_library(compiler, work / target.name)
    try:  # library first, sidecar last: a sidecar means the library beside it is whole
        os.replace(built, target)
        partial = root / f".{os.getpid()}.sha256"
        partial.write_text(file_digest(target))
        os.replace(partial, target.with_suffix(".sha256"))
    except OSError:
        return built
    shutil.rmtree(work, ignore_errors=True)
    return target


def compile_library(compiler: str, out: Path) -> Path:
    """Compile every source (each ISA file with its own flags, two at a time) and link."""
    jobs: list[tuple[str, tuple[str, ...]]] = [(s, (f"-march={MARCH}",)) for s in SOURCES]
    jobs += list(ISA_SOURCES.items())
    objects, running = [], []
    for source, flags in jobs:
        obj = out.parent / (Path(source).stem + ".o")
        cmd = [compiler, *FLAGS, *flags, "-c", str(CSRC / source), "-o", str(obj)]
        running.append((cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
        objects.append(str(obj))
        if len(running) >= max(2, os.cpu_count() or 1):
            wait_all(running)
    wait_all(running)
    link = [compiler, "-shared", *objects, "-o", str(out)]
    wait_all([(link, subprocess.Popen(link, stderr=subprocess.PIPE, text=True))])
    return out


def wait_all(running: list[tuple[list[str], subprocess.Popen[str]]]) -> None:
    """Wait for compiler processes; the first failure becomes a ``QuantreeError``."""
    failed = None
    for cmd, proc in running:
        _, err = proc.communicate()
        if proc.returncode != 0 and failed is None:
            failed = (cmd, err)
    running.clear()
    if failed is not None:
        cmd, err = failed
        raise QuantreeError(
            f"building quantree's CPU kernels failed ({' '.join(cmd)}):\n{err[-4000:]}\n"
            "Check the compiler (CXX), or set QUANTREE_NATIVE_MARCH to a -march it supports."
        )


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of a dense CPU tensor (None for an absent optional tensor).

    Dense means contiguous, or channels-last for the 4-d tensors of convolutions.
    """
    if t is None:
        return None
    if not t.is_cpu or not (
        t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=CHANNELS_LAST))
    ):
        raise ValueError("quantree's CPU kernels read dense CPU tensors only")
    return t.data_ptr()
