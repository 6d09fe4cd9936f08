"""The backend ``qt.quantize`` lowers to when none is named: the fastest this machine runs.

That is the CPU backend wherever its kernels load (prebuilt or compiled here), so the first
model a user quantizes is the one that is faster than float. Where they cannot load (no
compiler and no prebuilt library, an unsupported platform) the model stays the q/dq reference
graph, and one ``QuantreeWarning`` per process says why and how to ask for either explicitly.
The choice is made once per process: trying to build the kernels again on every call would
cost a compiler run each time.
"""

from __future__ import annotations

import functools
import warnings

import torch.fx as fx

from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.lower import REFERENCE, Backend

REFERENCE_KEY = "quantree_reference"
"""``GraphModule.meta`` key: the reference graph a lowered model was made from, so that what
reads only q/dq graphs (ONNX export) still works on ``qt.quantize``'s default output."""


@functools.cache
def fastest_backend() -> Backend:
    """``CPU`` if its kernels load on this machine, else ``REFERENCE`` with one warning."""
    from quantree.backends.cpu.backend import CPU
    from quantree.backends.cpu.native.loader import library

    try:
        library()
    except QuantreeError as error:
        warnings.warn(
            "qt.quantize returns the q/dq reference graph, which runs slower than float: "
            f"quantree's CPU kernels do not load here ({' '.join(str(error).split())}). "
            "Pass backend='reference' (or backend=None) to ask for the reference graph and "
            "silence this warning, or fix the cause and pass backend='cpu'.",
            QuantreeWarning,
            stacklevel=3,
        )
        return REFERENCE
    return CPU


def attach_reference(lowered: fx.GraphModule, reference: fx.GraphModule) -> fx.GraphModule:
    """Remember on ``lowered`` the reference graph it was lowered from (a no-op if the same)."""
    if lowered is not reference:
        lowered.meta[REFERENCE_KEY] = reference
    return lowered


def reference_of(gm: fx.GraphModule) -> fx.GraphModule | None:
    """The reference graph ``gm`` was lowered from by ``qt.quantize``, if it kept one."""
    found = gm.meta.get(REFERENCE_KEY)
    return found if isinstance(found, fx.GraphModule) else None
