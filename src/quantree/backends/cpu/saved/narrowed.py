"""Constants saved in the narrowest form that holds their values exactly.

A region program's instructions, slot table and shapes are int64 for the native code, but
their fields are small integers: opcodes, slot numbers, byte offsets (rnnt's predictor: 94 KB
of program for 16 unrolled steps, 8% of its int8 weights). Zero points are int32 and mostly
0. Per-channel weight scales are float32 of 11 significant bits (``core.qparams`` rounds them
so) whose range may lie below float16's (1e-5). A layer norm's weight and bias are all 1 and
all 0 until trained, a bias may be all 0. So a constant is saved as ``quantree.filled`` (one
number and a shape) when every element is the same, else in a narrower integer type, else
(float32) as float16 times a power of two, each as a recipe that ``load`` folds back once
(``derived.py``): the loaded tensor equals the lowered one bit for bit (checked here), and the
kernels read what they read before.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from quantree.backends.cpu.saved.derived import Recipe
from quantree.backends.cpu.saved.derived_ops import FILLED_DTYPES, MAX_EXPONENT
from quantree.backends.cpu.saved.nibbles import pack_grouped, pack_nibbles

MIN_SAVED_BYTES = 64
"""Save a constant narrow only where that saves at least this much: each recipe costs a node
in the graph description (a ``widened`` or ``filled`` call with its result's description;
its deflated size: benchmarks/README.md, "Figures moved from docstrings")."""
_NARROWER = {
    torch.int64: (torch.int8, torch.int16, torch.int32),
    torch.int32: (torch.int8, torch.int16),
    torch.int16: (torch.int8,),
    torch.float32: (torch.float16,),
}
_HALF_TOP = 14
"""float16's largest power of two below its maximum (65504) less one: values are scaled so
that the largest lands in [2^14, 2^15), which leaves 28 binades of normal float16 below it."""


def _bits(t: Tensor) -> Tensor:
    """``t``'s elements as integers of their width (so -0.0 differs from 0.0, NaN equals
    itself)."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(as_int[t.element_size()])


def _filled(t: Tensor) -> Recipe | None:
    """``filled(value, shape)`` when every element of ``t`` has the same bits."""
    if t.dtype not in FILLED_DTYPES or t.numel() < 2:
        return None
    bits = _bits(t).reshape(-1)
    if not bool((bits == bits[0]).all()):
        return None
    value = t.detach().reshape(-1)[0].item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    recipe = Recipe(torch.ops.quantree.filled.default, (value, list(t.shape), t.dtype))
    return recipe if torch.equal(_bits(recipe.compute()), _bits(t)) else None


def _exponent(t: Tensor) -> int:
    """The power of two that puts ``t``'s largest magnitude in [2^14, 2^15)."""
    top = float(t.detach().abs().max())
    if top == 0.0 or not math.isfinite(top):
        return 0
    return max(-MAX_EXPONENT, min(MAX_EXPONENT, _HALF_TOP - math.floor(math.log2(top))))


def narrowed(t: Tensor) -> Recipe | None:
    """How to save ``t`` in fewer bytes, exactly, if that saves enough: ``filled``,
    ``nibbles`` (int8 values all in [-8, 7]), ``grouped_nibbles`` (a grouped 4-bit weight),
    or ``widened(t in a narrower type)``."""
    if t.nbytes < MIN_SAVED_BYTES or t.layout != torch.strided:
        return None
    uniform = _filled(t)
    if uniform is not None:
        return uniform
    packed = pack_nibbles(t)  # a 4-bit weight (int8 storage on [-8, 7]): two a byte
    if packed is not None and t.nbytes - packed.nbytes >= MIN_SAVED_BYTES:
        return Recipe(torch.ops.quantree.nibbles.default, (packed, list(t.shape)))
    grouped = pack_grouped(t)  # a grouped 4-bit weight (``code * m`` a group): codes, m
    if grouped is not None:
        codes, multipliers, group = grouped
        if t.nbytes - codes.nbytes - multipliers.nbytes >= MIN_SAVED_BYTES:
            packed_args = (codes, multipliers, list(t.shape), group)
            return Recipe(torch.ops.quantree.grouped_nibbles.default, packed_args)
    for dtype in _NARROWER.get(t.dtype, ()):
        saved = t.numel() * (t.element_size() - torch.empty((), dtype=dtype).element_size())
        if saved < MIN_SAVED_BYTES:
            return None
        exponent = _exponent(t) if t.is_floating_point() else 0
        narrow = (t.detach() * 2.0**exponent).to(dtype).contiguous()
        args = (narrow, t.dtype, -exponent) if exponent else (narrow, t.dtype)
        recipe = Recipe(torch.ops.quantree.widened.default, args)
        if torch.equal(_bits(recipe.compute()), _bits(t)):
            return recipe
    return None
