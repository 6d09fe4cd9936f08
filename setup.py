"""Builds quantree's native CPU kernels with the package (metadata lives in pyproject.toml).

The kernels are plain C++ with no torch or Python headers. ``build_ext`` compiles them into
the extension module ``quantree.backends.cpu.native._kernels`` (a shared library that the runtime
loads through ctypes), so a wheel from ``pip wheel .`` runs on machines with no compiler.
Without a compiler here the build still succeeds, with a warning: the kernels are then
compiled on first use at run time (the fallback of ``native.py``), as in older releases.
Set ``QUANTREE_REQUIRE_KERNELS=1`` to make a failed kernel build fail the package build.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
BUILD_NATIVE = HERE / "src" / "quantree" / "backends" / "cpu" / "native" / "build.py"


def build_native_module():  # loaded by path: importing quantree would need torch
    spec = importlib.util.spec_from_file_location("quantree_build_native", BUILD_NATIVE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """Compiles the kernel library with build_native (each ISA file with its own flags)."""

    def build_extension(self, ext: Extension) -> None:
        native = build_native_module()
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        compiler = os.environ.get("CXX", "c++")
        try:
            if shutil.which(compiler) is None:
                raise native.BuildError(f"no C++ compiler {compiler!r} on PATH")
            stem = ext.name.rsplit(".", 1)[-1]
            variants = {
                PREFIX + suffix: march for march, suffix in native.PREBUILT_VARIANTS.items()
            }
            march = variants.get(stem, native.PORTABLE_MARCH)
            with tempfile.TemporaryDirectory() as tmp:
                built = native.compile_library(compiler, Path(tmp) / out.name, march)
                shutil.copyfile(built, out)
        except (native.BuildError, OSError) as error:
            if os.environ.get("QUANTREE_REQUIRE_KERNELS") == "1":
                raise
            print(
                f"warning: quantree's CPU kernels were not prebuilt ({error}); they will be "
                "compiled on first use, which needs a C++ compiler then"
            )


PREFIX = "_kernels"
# the baseline library, and variants whose code outside the ISA files targets a newer -march
# (the loader takes the best one the CPU has)
NAMES = [PREFIX] + [PREFIX + suffix for suffix in build_native_module().PREBUILT_VARIANTS.values()]

setup(
    ext_modules=[
        Extension(f"quantree.backends.cpu.native.{name}", sources=[], optional=True)
        for name in NAMES
    ],
    cmdclass={"build_ext": BuildKernels},
)
