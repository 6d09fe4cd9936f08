"""quantree's ExecuTorch kernel library: built against the installed executorch, loaded once.

``csrc/quantree_et_kernels.cpp`` registers ``quantree_et::rnn.out`` with ExecuTorch's
operator registry, which lives in the wheel's shared runtime ``libexecutorch.so`` (the one
``executorch.extension.pybindings`` links, as ``executorch.kernels.quantized``'s kernels
do). The library is compiled with the headers the wheel ships (``executorch/include``) and
the compile definitions its CMake package names, and linked against that runtime and
quantree's CPU kernels library (``native/loader.py``), whose ``qt_rnn`` does the work: one
compute core for both runtimes. Loading it (``load``) runs its registration; the Python
runtime must be imported first so that both resolve the same ``libexecutorch.so``.

Built on first use into the same cache as the CPU kernels (keyed by the source, the
executorch version and the kernels library it links), like them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from torch.utils import cpp_extension

from quantree.backends.cpu.native import build as build_native
from quantree.backends.cpu.native import loader
from quantree.core.errors import QuantreeError

SOURCE = Path(__file__).parent / "csrc" / "quantree_et_kernels.cpp"
DEFINES = ("-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED")
"""``EXECUTORCH_COMPILE_DEFINITIONS`` of the wheel's ``share/cmake/executorch-config.cmake``."""
NAME = "quantree_et_kernels"


def executorch_root() -> Path:
    """The installed ``executorch`` package directory (it is a namespace package)."""
    spec = importlib.util.find_spec("executorch")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / "include" / "executorch").is_dir():
            return Path(location)
    raise QuantreeError(
        "the installed executorch package ships no C++ headers (executorch/include), which "
        "quantree's ExecuTorch kernels are built against; install the executorch wheel "
        "(pip install --no-deps executorch==1.5.1)"
    )


def compile_command(out: Path, kernels: Path, compiler: str = "c++") -> list[str]:
    """The one compile-and-link command of the library (also what the docs show)."""
    root = executorch_root()
    include = root / "include"
    runtime = root / "lib"
    return [
        compiler, "-O2", "-std=c++17", "-fPIC", "-shared", *DEFINES,
        f"-I{include}", f"-I{include / 'executorch/runtime/core/portable_type/c10'}",
        f"-I{build_native.CSRC}", str(SOURCE), str(kernels),
        f"-L{runtime}", "-lexecutorch", f"-Wl,-rpath,{runtime}", "-o", str(out),
    ]  # fmt: skip


def version() -> str:
    try:
        from importlib.metadata import version as installed

        return installed("executorch")
    except Exception:  # an unversioned source install
        return "unknown"


def library_path() -> Path:
    """The built library for this executorch and these kernels: from the cache or built now."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise QuantreeError(
            f"quantree's ExecuTorch kernels are built on first use with a C++ compiler: "
            f"{compiler!r} (from $CXX, default c++) is not on PATH; install one (apt-get install "
            "g++) or set CXX"
        )
    kernels = loader.library_path()
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), (build_native.CSRC / "qt_rnn.h").read_bytes()):
        digest.update(part)
    digest.update(f"{version()} {kernels} {loader.file_digest(kernels)} {compiler}".encode())
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    root = Path(cache) / f"{NAME}_{digest.hexdigest()[:16]}"
    target = root / f"{NAME}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
    built = work / target.name
    done = subprocess.run(
        compile_command(built, kernels, compiler), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise QuantreeError(
            f"building quantree's ExecuTorch kernels failed:\n{done.stderr[-4000:]}\nCheck the "
            "compiler (CXX) and that the executorch wheel's headers match its runtime"
        )
    os.replace(built, target)  # whole or not at all
    shutil.rmtree(work, ignore_errors=True)
    return target


@functools.cache
def load() -> Path:
    """Build (once) and load the library into this process: ``quantree_et::rnn.out`` is then
    registered with the runtime ``executorch.runtime`` runs programs with. Returns its path."""
    import executorch.extension.pybindings.portable_lib  # noqa: F401  (the runtime, first)

    path = library_path()
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        raise QuantreeError(
            f"quantree's ExecuTorch kernels at {path} do not load: {error}; delete that "
            "directory (it is rebuilt on the next use)"
        ) from error
    # its registration chose the best kernel path; the process keeps the one quantree chose
    # (QUANTREE_CPU_ISA, QUANTREE_NATIVE_MARCH)
    loader.library().qt_select_isa(loader.isa_cap())
    return path
