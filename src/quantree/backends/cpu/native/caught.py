"""What a kernel's C++ caught, raised in Python.

No C++ exception crosses the kernels' ``extern "C"`` entry points: each wraps its body in
``QT_CATCH`` (``csrc/qt_kernels.h``), which records the error in a per-thread slot. The
loader gives every declared entry point the ``errcheck`` built here, so a failed allocation
or any other exception inside a kernel becomes a Python exception at the call, never a
SIGABRT of the process.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

from quantree.backends.cpu.native.checks import NativeArgumentError, NativeMemoryError


@functools.cache
def caught(lib: ctypes.CDLL) -> Callable[..., Any]:
    """The ``errcheck`` every entry point of ``lib`` gets (``raise_caught`` on its error slot)."""
    return raise_caught(lib.qt_take_error, ctypes.c_int.in_dll(lib, "qt_errors_pending"))


def raise_caught(take_error: Callable[[], int], pending: ctypes.c_int) -> Callable[..., Any]:
    """The ``errcheck`` of every entry point: what its C++ caught (``QT_CATCH`` in
    ``csrc/qt_kernels.h``: no exception crosses ``extern "C"``) raised here, as a Python
    exception: ``NativeMemoryError`` (a ``MemoryError``) for an allocation that failed,
    ``NativeArgumentError`` for anything else. ``pending`` (errors recorded on any thread,
    not yet taken) is read first: no second foreign call when it is 0."""

    def errcheck(result: Any, func: Any, args: tuple) -> Any:
        error = take_error() if pending.value else 0
        if error:
            name = getattr(func, "__name__", "a native kernel")
            if error == 1:
                raise NativeMemoryError(
                    f"{name} could not allocate its workspace (std::bad_alloc); nothing was "
                    "returned. Run it on fewer rows, or with more memory"
                )
            raise NativeArgumentError(
                f"{name} stopped on a C++ exception (error {error}); nothing was returned"
            )
        return result

    return errcheck
