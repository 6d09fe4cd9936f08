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

A library built when the package was built or installed (``setup.py``; the extension module
``quantree.backends.cpu.native._kernels`` beside this file, and its ``_x86_64_v3`` / ``_x86_64_v4``
variants, of which the best the CPU has is taken) is used first, with no compiler: it is
taken when it was built from the sources beside it (it reports their digest), the march is
``native`` or one of ``ISA_CAP`` (the path is chosen at load either way), and
``QUANTREE_NATIVE_PREBUILT`` is not ``0``. Otherwise the library is compiled here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

from quantree.backends.cpu.native import build as build_native
from quantree.backends.cpu.native.caught import caught
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.core.errors import QuantreeError

CSRC = build_native.CSRC
SOURCES = build_native.SOURCES
HEADERS = build_native.HEADERS
X86 = build_native.X86
ISA_SOURCES = build_native.ISA_SOURCES
"""Per instruction set: its file and the flags it alone is compiled with."""
CHANNELS_LAST = torch.channels_last
MARCH = os.environ.get("QUANTREE_NATIVE_MARCH", "native")
"""``-march`` of the portable code, and a cap on the path: see ``ISA_CAP``."""
SANITIZE = os.environ.get("QUANTREE_NATIVE_SANITIZE", "").strip()
"""``address``: an AddressSanitizer build (``build_native.SANITIZERS``), run with libasan
preloaded into the process (``tests/backends/test_native_asan.py``); never the prebuilt one."""
FLAGS = build_native.FLAGS
ISA_NAMES = ("portable", "avx2", "avxvnni", "avx512vnni", "neon", "neondot")
"""The kernel paths, by the number ``qt_select_isa`` takes and returns (``qt::Isa``)."""
ISA_CAP = {"x86-64": 0, "x86-64-v2": 0, "x86-64-v3": 1, "x86-64-v4": 1}
"""``QUANTREE_NATIVE_MARCH`` values that cap the path (v4 has no VNNI); others do not."""
PREBUILT_STEM = "_kernels"
"""The extension module ``setup.py`` builds beside this file."""

I64, INT, F32, PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
"""The ctypes of the kernels' arguments: int64_t, int, float, and any pointer."""


def kernels(
    signatures: Mapping[str, Sequence[type]], returns: Mapping[str, type] | None = None
) -> Callable[[], ctypes.CDLL]:
    """The library, once ``signatures`` (C symbol -> its ctypes argument types) and
    ``returns`` (C symbol -> its result type; void if absent) are declared on it.

    Each native op module declares the C entry points it calls and calls them through
    ``kernels(SIGNATURES)()``: one place per op, no table here to keep in step. Each entry
    point raises what its C++ caught (``raise_caught``).
    """

    @functools.cache
    def declared() -> ctypes.CDLL:
        lib = library()
        for symbol, argtypes in signatures.items():
            fn = getattr(lib, symbol)
            fn.argtypes = list(argtypes)
            fn.restype = (returns or {}).get(symbol)
            fn.errcheck = caught(lib)
        return lib

    return declared


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
    lib = prebuilt_library()
    if lib is None:
        path = build(library_name())
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise QuantreeError(
                f"quantree's CPU kernels at {path} do not load: {error}. Delete that directory "
                "(it is rebuilt on the next use), or point TORCH_EXTENSIONS_DIR elsewhere."
            ) from error
    lib.qt_take_error.argtypes = []
    lib.qt_take_error.restype = INT
    # the error plumbing's own probe (tests/backends/test_native_guard.py): not an op
    lib.qt_guard_probe.argtypes = [INT]
    lib.qt_guard_probe.restype = None
    lib.qt_guard_probe.errcheck = caught(lib)
    lib.qt_select_isa.argtypes = [INT]
    lib.qt_select_isa.restype = INT
    lib.qt_current_isa.restype = INT
    # AMX tiles for the AVX-512 VNNI path's GEMMs: -1 asks; 0 off, 1 where they pay, 2 for
    # every product of 16 rows and more (checks); the same bits in every mode
    lib.qt_amx.argtypes = [INT]
    lib.qt_amx.restype = INT
    lib.qt_cpu_features.restype = INT
    lib.qt_isa_for.argtypes = [INT, INT]
    lib.qt_isa_for.restype = INT
    if ISA_NAMES[lib.qt_select_isa(isa_cap())] == "portable":
        warnings.warn(portable_warning(lib.qt_cpu_features()), RuntimeWarning, stacklevel=2)
    return lib


V3 = "the rest of x86-64-v3 (BMI1, BMI2, F16C, LZCNT, MOVBE)"
V4 = "the rest of x86-64-v4 (AVX-512 CD, DQ)"
FEATURES = {
    "AVX2": 1,
    "FMA": 2,
    "AVX-VNNI": 4,
    "AVX-512F": 8,
    "AVX-512BW": 16,
    "AVX-512VL": 32,
    "AVX-512 VNNI": 64,
    "ASIMD (NEON)": 128,
    "the dot-product extension (sdot)": 256,
    V3: 512,
    V4: 1024,
}
"""The bits of ``qt_cpu_features()`` (and of ``qt_isa_for``'s first argument). Each x86
path needs the whole -march level its files are compiled with, not only its own features."""


def portable_warning(features: int, arm: bool | None = None) -> str:
    """What lowering says once when the kernels take the portable path: what the
    CPU lacks for each vector path, or which variable keeps it from using them."""
    arm = build_native.ARM64 if arm is None else arm
    needs = (
        {"neon": ("ASIMD (NEON)",)}
        if arm
        else {
            "avx2": ("AVX2", "FMA", V3),
            "avxvnni": ("AVX2", "FMA", V3, "AVX-VNNI"),
            "avx512vnni": ("AVX-512F", "AVX-512BW", "AVX-512VL", V4, "AVX-512 VNNI"),
        }
    )
    if not arm and not X86:
        why = f"quantree has no vector kernels for {build_native.MACHINE or 'this CPU'}"
    else:
        lacking = {path: absent(features, names) for path, names in needs.items()}
        if all(lacking.values()):
            why = "the CPU lacks " + "; ".join(
                f"{', '.join(missing)} (the {path} path)" for path, missing in lacking.items()
            )
        else:
            chosen = os.environ.get("QUANTREE_CPU_ISA", "").strip()
            forced = f"QUANTREE_CPU_ISA={chosen}" if chosen else f"QUANTREE_NATIVE_MARCH={MARCH}"
            has = [path for path, missing in lacking.items() if not missing]
            why = (
                f"{forced} restricts it, although the CPU has what the {', '.join(has)} "
                "path needs; a CPU with none of them lacks "
                + "; ".join(f"{', '.join(names)} ({path})" for path, names in needs.items())
            )
    return (
        "quantree's CPU backend runs its portable kernels on this machine (SSE2 on x86-64, "
        "plain C++ elsewhere), 2-4x slower than its vector paths and no faster than float "
        f"PyTorch: {why}. Deploy to a CPU with AVX2 (x86-64-v3) or aarch64 NEON for fast "
        "int8 inference."
    )


def absent(features: int, names: tuple[str, ...]) -> list[str]:
    """What of ``names`` the CPU lacks; "the rest of" a level is named only when the
    features before it are all there (otherwise they say enough)."""
    lacks = [name for name in names if not features & FEATURES[name]]
    return [name for name in lacks if name not in (V3, V4)] or lacks


def prebuilt_path() -> Path | None:
    """The baseline library built with the package (``setup.py``), if there is one."""
    return prebuilt_file("")


def prebuilt_file(variant: str) -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{PREBUILT_STEM}{variant}{suffix}"
        if path.is_file():
            return path
    return None


@functools.cache
def prebuilt_choice() -> tuple[Path, ctypes.CDLL] | None:
    """The prebuilt library for this process (see the module docstring): the baseline one,
    or the best variant (``native.build.PREBUILT_VARIANTS``) the CPU has and the march
    allows."""
    base = prebuilt_path()
    if (
        base is None
        or SANITIZE
        or os.environ.get("QUANTREE_NATIVE_PREBUILT", "1") == "0"
        or not (MARCH == "native" or MARCH in ISA_CAP)
    ):
        return None
    lib = load_prebuilt(base)
    if lib is None:
        return None
    lib.qt_cpu_features.restype = INT
    features = lib.qt_cpu_features()
    order = ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"]  # the keys of ISA_CAP
    ceiling = len(order) if MARCH == "native" else order.index(MARCH)
    bits = {"x86-64-v3": 512, "x86-64-v4": 1024}  # qt_cpu_features
    for march, suffix in reversed(build_native.PREBUILT_VARIANTS.items()):
        if order.index(march) <= ceiling and features & bits[march]:
            path = prebuilt_file(suffix)
            better = load_prebuilt(path) if path is not None else None
            if path is not None and better is not None:
                return path, better
    return base, lib


def load_prebuilt(path: Path) -> ctypes.CDLL | None:
    """A prebuilt library, if it loads and was built from the sources beside it."""
    try:
        lib = ctypes.CDLL(str(path))
        lib.qt_source_digest.restype = ctypes.c_char_p
        built_from = lib.qt_source_digest().decode()
    except (OSError, AttributeError):
        return None  # damaged or foreign: the runtime build takes over
    return lib if built_from == build_native.sources_digest() else None


def prebuilt_library() -> ctypes.CDLL | None:
    """The prebuilt library when one may serve this process."""
    choice = prebuilt_choice()
    return None if choice is None else choice[1]


def library_path() -> Path:
    """Where the library this process uses lives (the prebuilt one, or the built one)."""
    library()
    choice = prebuilt_choice()
    return choice[0] if choice is not None else build(library_name())


def cpu_isa() -> str:
    """The kernel path this process runs: ``avx512vnni``, ``avxvnni``, ``avx2`` or
    ``portable`` (the best the CPU reports, capped by ``QUANTREE_NATIVE_MARCH``)."""
    return ISA_NAMES[library().qt_current_isa()]


def library_name() -> str:
    """The library's file stem; the march is part of it, so builds never overwrite others."""
    suffix = "" if MARCH == "native" else "_" + MARCH.replace("-", "_").replace(".", "_")
    return "quantree_cpu_kernels" + suffix + (f"_{SANITIZE}" if SANITIZE else "")


def source_digest(compiler: str) -> str:
    """A hash of everything the build reads: sources, headers, flags, the compiler, and what
    the march means on this machine (``build_native.march_meaning``: ``native`` is this
    CPU's instruction set, so a cache shared with another CPU holds one library each)."""
    meaning = build_native.march_meaning(compiler, MARCH) if MARCH == "native" else ""
    key = (FLAGS, MARCH, ISA_SOURCES, compiler, meaning, sanitizer_flags())
    digest = hashlib.sha256(repr(key).encode())
    digest.update(build_native.sources_digest().encode())
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


def sanitizer_flags() -> tuple[str, ...]:
    """The compile and link flags ``QUANTREE_NATIVE_SANITIZE`` asks for (none by default)."""
    if SANITIZE not in ("", *build_native.SANITIZERS):
        raise QuantreeError(
            f"QUANTREE_NATIVE_SANITIZE={SANITIZE!r} is not a sanitizer quantree builds; use "
            f"one of {', '.join(build_native.SANITIZERS)}, or unset it"
        )
    return build_native.SANITIZERS.get(SANITIZE, ())


def compile_library(compiler: str, out: Path) -> Path:
    """Compile every source (each ISA file with its own flags, two at a time) and link."""
    try:
        return build_native.compile_library(compiler, out, MARCH, extra=sanitizer_flags())
    except build_native.BuildError as error:
        raise QuantreeError(
            f"building quantree's CPU kernels failed ({error})\n"
            "Check the compiler (CXX), or set QUANTREE_NATIVE_MARCH to a -march it supports."
        ) from error


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of a dense CPU tensor (None for an absent optional tensor).

    Dense means contiguous, or channels-last for the 4-d tensors of convolutions.
    """
    if t is None:
        return None
    if not t.is_cpu or not (
        t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=CHANNELS_LAST))
    ):
        raise NativeArgumentError(
            f"a tensor of shape {tuple(t.shape)}, strides {t.stride()} on {t.device} reached "
            "quantree's CPU kernels, which read dense CPU tensors only; the native kernel was "
            "not run (an op copies strided inputs through native/args.py: NativeArgs)"
        )
    return t.data_ptr()
