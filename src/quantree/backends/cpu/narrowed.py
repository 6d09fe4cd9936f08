"""Constants saved in the narrowest type that holds their values exactly.

A region program's instructions, slot table and shapes are int64 for the native code, but
their fields are small integers: opcodes, slot numbers, byte offsets (rnnt's predictor: 94 KB
of program for 16 unrolled steps, 8% of its int8 weights). Zero points are int32 and mostly
0. Any such constant whose values fit a narrower integer type (or, for float32, whose values
half precision holds bit for bit) is saved in that type as the argument of
``quantree.widened``, which ``load`` folds back once like any recipe (``derived.py``): the
loaded tensor equals the lowered one exactly, and the kernels read what they read before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.derived import Recipe

MIN_SAVED_BYTES = 256
"""Narrow only where it saves at least this much: each recipe costs a node in the graph."""
_NARROWER = {
    torch.int64: (torch.int8, torch.int16, torch.int32),
    torch.int32: (torch.int8, torch.int16),
    torch.int16: (torch.int8,),
    torch.float32: (torch.float16,),
}


def narrowed(t: Tensor) -> Recipe | None:
    """``widened(t in a narrower type)`` when that type holds ``t`` exactly and saves enough."""
    for dtype in _NARROWER.get(t.dtype, ()):
        saved = t.numel() * (t.element_size() - torch.empty((), dtype=dtype).element_size())
        if saved < MIN_SAVED_BYTES:
            return None
        narrow = t.detach().to(dtype).contiguous()
        back = narrow.to(t.dtype)
        if t.is_floating_point():
            exact = bool(
                torch.equal(back.view(torch.int32), t.detach().contiguous().view(torch.int32))
            )
        else:
            exact = bool(torch.equal(back, t))
        if exact:
            return Recipe(torch.ops.quantree.widened.default, (narrow, t.dtype))
    return None
