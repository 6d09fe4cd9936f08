"""How a region program moves rows: permutes, broadcasts and reshapes of its 2-d slots.

A program's values are ``[rows, cols]`` slices of one workspace (``csrc/qt_program.h``), the
last dimension the columns. Attention blocks reshape between the two layouts on every call:
a projection's ``[S, H * D]`` is viewed as ``[S, H, D]`` and transposed to ``[H, S, D]``
for the attention, LLaMA's rotary tables ``[S, D]`` broadcast over the heads, grouped-query
attention expands ``[Hkv, S, D]`` to ``[H, S, D]``, and the output is transposed back and
merged to ``[S, H * D]``. As ATen ops each is a dispatcher call that also ends a program
(its value read outside it). Every one of them keeps the last dimension, so each output row
is one source row: here they are ``COPY`` instructions over strided row views (a row stride
of 0 repeats a row), and a reshape of dense rows is a new view of the same bytes.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from quantree.backends.cpu.cells.program import Program

COPY = 5
MAX_COPIES = 4096
"""More row blocks than this (a transpose of many tiny rows) is left to ATen."""


def row_map(
    src: tuple[Any, ...], out: tuple[Any, ...], perm: list[int] | None
) -> list[tuple[int, int]] | None:
    """For each leading dimension of ``out``: its size and the source row stride it steps
    (0 where ``src`` is broadcast). ``perm``: ``out`` is ``src`` permuted so (else ``out`` is
    ``src`` broadcast). None where the last dimension moves or a size is symbolic."""
    if not src or not out or any(type(d) is not int for d in (*src, *out)) or src[-1] != out[-1]:
        return None
    lead = src[:-1]
    strides = [math.prod(lead[i + 1 :]) for i in range(len(lead))]
    if perm is not None:
        perm = [d % len(src) for d in perm]
        if len(perm) != len(src) or perm[-1] != len(src) - 1 or len(out) != len(src):
            return None
        return [(src[perm[j]], strides[perm[j]]) for j in range(len(out) - 1)]
    pad = len(out) - len(src)
    if pad < 0:
        return None
    dims = []
    for j in range(len(out) - 1):
        i = j - pad
        if i < 0 or src[i] == 1:
            dims.append((out[j], 0))
        elif src[i] == out[j]:
            dims.append((out[j], strides[i]))
        else:
            return None
    return dims


def copies(dims: list[tuple[int, int]]) -> int:
    """How many ``COPY`` instructions ``gather`` emits for ``dims``."""
    sizes = [size for size, _ in dims] or [1]
    return math.prod(sizes) // max(sizes)


def _strided(p: Program, source: int, first_row: int, rows: int, step: int) -> int:
    """A view of ``rows`` rows of ``source`` from ``first_row``, every ``step``-th one."""
    dtype, base, offset, cols, ld, _ = p.slots[source]
    elem = 4 if dtype == 0 else 1
    p.slots.append([dtype, base, offset + first_row * ld * elem, cols, ld * step, rows])
    return len(p.slots) - 1


def gather(p: Program, source: int, dims: list[tuple[int, int]]) -> int:
    """A new dense slot whose rows, indexed by ``dims``' sizes, are ``source``'s rows at
    the strides ``dims`` give: one ``COPY`` per block along the largest dimension."""
    dtype, _, _, cols, _, _ = p.slots[source]
    dims = dims or [(1, 0)]
    sizes = [size for size, _ in dims]
    out_strides = [math.prod(sizes[j + 1 :]) for j in range(len(sizes))]
    dst = len(p.slots)
    p.slots.append([dtype, dst, 0, cols, cols, math.prod(sizes)])
    inner = max(range(len(dims)), key=lambda j: sizes[j])
    others = [j for j in range(len(dims)) if j != inner]
    for index in itertools.product(*(range(sizes[j]) for j in others)):
        src_row = sum(i * dims[j][1] for i, j in zip(index, others, strict=True))
        dst_row = sum(i * out_strides[j] for i, j in zip(index, others, strict=True))
        part = _strided(p, dst, dst_row, sizes[inner], out_strides[inner])
        p.emit([COPY, part, _strided(p, source, src_row, sizes[inner], dims[inner][1])], [])
    return dst


def reshape(p: Program, source: int, rows: Any, cols: int) -> int:
    """``source``'s elements in row-major order as ``rows x cols``: a view when its rows are
    dense, else a dense copy first."""
    dtype, base, offset, width, ld, n = p.slots[source]
    if ld != width:
        base, offset = len(p.slots), 0
        p.slots.append([dtype, base, 0, width, width, n])
        p.emit([COPY, base, source], [])
    p.slots.append([dtype, base, offset, cols, cols, rows])
    return len(p.slots) - 1
