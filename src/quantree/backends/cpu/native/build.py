"""Compile quantree's C++ int8 kernels into one shared library (no torch, no quantree).

Used twice: by ``setup.py`` when the package is built or installed (the library then ships
in the wheel as the extension module ``quantree.backends.cpu.native._kernels``, so a deployment
machine needs no compiler), and by ``native.py`` at run time when no usable prebuilt
library is there (an editable install whose sources changed, a custom
``QUANTREE_NATIVE_MARCH``). This module imports nothing but the standard library, so the
build backend can load it by path.

The library holds every x86 kernel path (each ISA file compiled with its own flags); the
path is chosen when it loads, from cpuid. ``qt_source_digest()`` in the library returns the
digest of the sources it was built from, so a prebuilt library that no longer matches its
sources is never used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
MACHINE = platform.machine().lower()
X86 = MACHINE in ("x86_64", "amd64")
ARM64 = MACHINE in ("aarch64", "arm64")
X86_ISA_SOURCES: dict[str, tuple[str, ...]] = {
    "isa_avx512.cpp": ("-march=x86-64-v4", "-mavx512vnni"),
    "attention_avx512.cpp": ("-march=x86-64-v4",),
    "attention_avx2.cpp": ("-march=x86-64-v3",),
    "program_avx512.cpp": ("-march=x86-64-v4",),
    "program_avx2.cpp": ("-march=x86-64-v3",),
    "isa_avxvnni.cpp": ("-march=x86-64-v3", "-mavxvnni"),
    "isa_avx2.cpp": ("-march=x86-64-v3",),
    "isa_avx2_w7.cpp": ("-march=x86-64-v3",),
    "conv_narrow_vnni.cpp": ("-march=x86-64-v4", "-mavx512vnni"),
    "conv_narrow_avx2.cpp": ("-march=x86-64-v3",),
    "conv1d_w16_avx2.cpp": ("-march=x86-64-v3",),
    "norm_block_avx2.cpp": ("-march=x86-64-v3",),
}
ARM64_ISA_SOURCES: dict[str, tuple[str, ...]] = {
    "isa_neon.cpp": ("-march=armv8-a",),
    "isa_neondot.cpp": ("-march=armv8.2-a+dotprod",),
}
ISA_SOURCES = X86_ISA_SOURCES if X86 else (ARM64_ISA_SOURCES if ARM64 else {})
SOURCES = tuple(
    sorted(
        path.name
        for path in CSRC.glob("*.cpp")
        if path.name not in X86_ISA_SOURCES and path.name not in ARM64_ISA_SOURCES
    )
)
"""The portable sources: every ``.cpp`` in ``csrc/`` but the instruction-set files, so a new
op's kernel file is compiled with no list to edit."""
HEADERS = tuple(sorted(path.name for path in CSRC.glob("*.h")))
"""Per instruction set of this machine: its file and the flags it alone is compiled with."""
FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-fPIC", f"-I{CSRC}")
PORTABLE_MARCH = "x86-64" if X86 else ("armv8-a" if ARM64 else "")
"""``-march`` of the portable code in a prebuilt (redistributable) library."""
PREBUILT_VARIANTS: dict[str, str] = (
    {"x86-64-v3": "_x86_64_v3", "x86-64-v4": "_x86_64_v4"} if X86 else {}
)
"""Further prebuilt libraries, by the ``-march`` of their code outside the ISA files (what the
compiler vectorizes on its own: im2col, quantize, tables, ...): file stem suffix. The loader
takes the best one the CPU (and ``QUANTREE_NATIVE_MARCH``) allows, else the baseline one."""


SANITIZERS: dict[str, tuple[str, ...]] = {
    "address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"),
}
"""Flags of the sanitizer builds (``QUANTREE_NATIVE_SANITIZE``), compile and link: checks,
not speed, so -O1 (it builds faster and reports exact lines)."""


OBJECT_CACHE = "QUANTREE_NATIVE_OBJECT_CACHE"
"""An environment variable naming a directory where compiled objects are kept, keyed by their
whole compile command and the bytes it reads (unset: none is kept). The test suite sets it
for its run, so the many builds it exercises (fresh caches, rebuilds, other marches) compile
each distinct object once; every build still links its own library."""


class BuildError(RuntimeError):
    """A compiler invocation failed; the message holds the command and its errors."""


def sources_digest() -> str:
    """A hash of the kernel sources and headers (what a prebuilt library records)."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *X86_ISA_SOURCES, *ARM64_ISA_SOURCES, *HEADERS):
        path = CSRC / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b""))
    return digest.hexdigest()[:16]


@functools.cache
def march_meaning(compiler: str, march: str) -> str:
    """What ``-march=<march>`` makes ``compiler`` target on this machine: a digest of the
    macros it predefines with it (``__AVX512F__``, ``__AVX2__``, ``__ARM_FEATURE_DOTPROD``...).

    ``native`` means the build host's CPU: a library built with it on an AVX-512 machine
    and found in the same cache by an AVX2 one (a shared home, NFS, a container image)
    would die there with SIGILL at the first call. The cache key holds this digest, so the
    other CPU builds its own. A compiler that cannot say gives ``"unknown"`` plus the
    machine's CPU description, which still separates CPUs that differ.
    """
    cmd = [compiler, f"-march={march}", "-dM", "-E", "-x", "c++", "-"]
    try:
        done = subprocess.run(
            cmd, input="", capture_output=True, text=True, timeout=60, check=False
        )
        text = done.stdout if done.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        text = ""
    if not text:
        text = "unknown " + cpu_description()
    defines = sorted(line for line in text.splitlines() if line.startswith("#define"))
    return hashlib.sha256("\n".join(defines).encode()).hexdigest()[:16]


def cpu_description() -> str:
    """The CPU's model and flags as the OS reports them (empty where it does not)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keys}))


def compile_objects(
    compiler: str,
    outdir: Path,
    march: str,
    isa_sources: dict[str, tuple[str, ...]] | None = None,
    extra: tuple[str, ...] = (),
    more: tuple[Path, ...] = (),
) -> list[str]:
    """Compile every source (each ISA file with its own flags, two at a time) into
    ``outdir``; ``more`` are further sources compiled like the portable ones (tests).

    ``march`` is the ``-march`` of the portable sources (empty: the compiler's default).
    Raises ``BuildError`` on the first failing command.
    """
    isa = ISA_SOURCES if isa_sources is None else isa_sources
    digest = f'-DQT_SOURCE_DIGEST="{sources_digest()}"'
    base = (f"-march={march}",) if march else ()
    jobs: list[tuple[Path, tuple[str, ...]]] = [(CSRC / s, base) for s in SOURCES]
    jobs += [(CSRC / s, flags) for s, flags in isa.items()]
    jobs += [(path, base) for path in more]
    objects: list[str] = []
    running: list[tuple[list[str], subprocess.Popen[str]]] = []
    kept: list[tuple[Path, Path]] = []
    cache = os.environ.get(OBJECT_CACHE)
    for source, flags in jobs:
        obj = outdir / (source.stem + ".o")
        cmd = [compiler, *FLAGS, *extra, digest, *flags, "-c", str(source)]
        objects.append(str(obj))
        if cache:
            stored = Path(cache) / (object_key(cmd, source) + ".o")
            if stored.is_file():
                shutil.copyfile(stored, obj)
                continue
            kept.append((obj, stored))
        cmd += ["-o", str(obj)]
        running.append((cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
        if len(running) >= max(2, os.cpu_count() or 1):
            wait_all(running)
    wait_all(running)
    for obj, stored in kept:  # whole objects only: written aside, then renamed into place
        with contextlib.suppress(OSError):
            partial = stored.with_suffix(f".{os.getpid()}.part")
            stored.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(obj, partial)
            os.replace(partial, stored)
    return objects


def object_key(cmd: list[str], source: Path) -> str:
    """What an object depends on: its command (compiler, flags, the kernel sources' digest)
    and the source and headers beside it (a test's extra source is not in that digest)."""
    digest = hashlib.sha256("\0".join(cmd).encode())
    for path in (source, *sorted(source.parent.glob("*.h"))):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def compile_library(
    compiler: str,
    out: Path,
    march: str,
    isa_sources: dict[str, tuple[str, ...]] | None = None,
    extra: tuple[str, ...] = (),
) -> Path:
    """Compile every source and link them into the shared library ``out``."""
    objects = compile_objects(compiler, out.parent, march, isa_sources, extra)
    link = [compiler, "-shared", *extra, *objects, "-o", str(out)]
    wait_all([(link, subprocess.Popen(link, stderr=subprocess.PIPE, text=True))])
    for obj in objects:
        Path(obj).unlink(missing_ok=True)
    return out


def link_program(compiler: str, objects: list[str], out: Path, extra: tuple[str, ...] = ()) -> Path:
    """Link objects into an executable (the C-level kernel check)."""
    cmd = [compiler, *extra, *objects, "-o", str(out)]
    wait_all([(cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))])
    return out


def wait_all(running: list[tuple[list[str], subprocess.Popen[str]]]) -> None:
    """Wait for compiler processes; the first failure becomes a ``BuildError``."""
    failed = None
    for cmd, proc in running:
        _, err = proc.communicate()
        if proc.returncode != 0 and failed is None:
            failed = (cmd, err)
    running.clear()
    if failed is not None:
        cmd, err = failed
        raise BuildError(f"{' '.join(cmd)}:\n{err[-4000:]}")
