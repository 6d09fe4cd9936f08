"""Build (once, cached) and load quantree's C++ int8 kernels.

The kernels are plain C functions with no torch headers, so they compile in seconds with
``torch.utils.cpp_extension.load`` (``-O3 -march=native``; the build lands in torch's
extensions directory and is reused until the sources change), or with one direct compiler
call into the same directory when ninja is not installed. They are called through
``ctypes`` with tensor data pointers: no pybind11, and about a microsecond per call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("gemm.cpp", "layers.cpp", "rnn.cpp", "cells.cpp", "pool.cpp")
HEADERS = ("qt_kernels.h", "qt_vmath.h")
CHANNELS_LAST = torch.channels_last
MARCH = os.environ.get("QUANTREE_NATIVE_MARCH", "native")
"""``-march`` of the build; e.g. ``x86-64-v3`` exercises the portable path without AVX-512."""
FLAGS = ("-O3", f"-march={MARCH}", "-ffp-contract=off", "-std=c++17")

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


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels (built on first use, then loaded from torch's cache)."""
    suffix = "" if MARCH == "native" else "_" + MARCH.replace("-", "_").replace(".", "_")
    name = "quantree_cpu_kernels" + suffix
    if cpp_extension.is_ninja_available():
        path = cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(FLAGS),
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
            verbose=False,
        )
    else:  # no ninja: one direct compiler call into the same cache
        path = build_without_ninja(name)
    lib = ctypes.CDLL(str(path))
    for symbol, argtypes in SIGNATURES.items():
        fn = getattr(lib, symbol)
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def build_without_ninja(name: str) -> Path:
    """Compile the kernels with ``$CXX`` (default ``c++``) when ninja is not installed.

    The output is keyed by a hash of the sources and flags, so edits rebuild.
    """
    digest = hashlib.sha256(repr(FLAGS).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update((CSRC / source).read_bytes())
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    root = Path(cache) / f"{name}_{digest.hexdigest()[:12]}"
    target = root / f"{name}.so"
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        compiler = os.environ.get("CXX", "c++")
        sources = [str(CSRC / s) for s in SOURCES]
        partial = root / f"{name}.{os.getpid()}.so"
        subprocess.run(
            [compiler, *FLAGS, "-shared", "-fPIC", f"-I{CSRC}", *sources, "-o", str(partial)],
            check=True,
        )
        partial.replace(target)  # atomic: concurrent builders never load half a file
    return target


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
