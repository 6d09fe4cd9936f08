"""The contracts of the native programs: region programs and cell loops.

Over 400 lines: the one contract of both native interpreters' tables (slots, views,
instructions, constants), proven once per table and cached; its halves share the verdict.

``qt_program_run`` (``csrc/program.cpp``) and ``qt_cell_loop`` (``csrc/cells.cpp``) lay a
workspace out from a slot table and run instructions (``csrc/qt_program.h``, ``run_op``)
that index slots and constant tensors with integers from the tables. A table from a file
could name a slot past the table, a view past its owner, a constant too short or of another
dtype: the instructions would then read and write outside the workspace. Checking the tables
costs O(their length), so the verdict on one set of tables is cached, keyed by each table
tensor's identity, version, address and shape (an in-place change, ``resize_`` or a
replaced ``.data`` revalidates) and by the integer lists. What a call adds is O(1) per input,
output and constant: dtypes, sizes for this call's size symbol, and the workspace's bytes.

A slot's rows and byte offset are ``a + b * s`` of the call's size symbol ``s >= 0`` (a
dynamic program's batch; 1 for a static one; the batch of a cell loop, whose rows are all
``s``). Every bound below is linear in ``s``, so it is proven for every ``s >= 0`` by its
value at the smallest ``s`` it applies to and its slope.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.fx.operator_schemas import normalize_function

from quantree.backends.cpu.native.checks import F32, I8, I32, I64, LIMIT, fail

NI, NF = 12, 8  # int / float fields per instruction (qt_program.h)
QUANT, DEQUANT, LINEAR, BINARY, LOOKUP, COPY, FAKE_QUANT, FLOAT_BINARY, FLOAT_UNARY, NORM = range(
    10
)
LINEAR16 = 10  # float rows split into two int8 planes, then one dual pass (ops_wide.py)
RMS_NORM = 11  # float rows times rsqrt(mean of squares + eps), then an optional weight
FLOAT_SCALAR, MATMUL, FLOAT_MATMUL = 12, 13, 14  # a op scalar; batched int8 / float a @ b
ATTENTION = 15  # float softmax(q k^T * scale + mask) v, heads as column blocks of 2-d rows
TRANSPOSE, ROW_SUM = 20, 21  # each batch's [R, C] as [C, R]; a float row's sum
CUMSUM, TRI_FILL, STRIDED = 22, 23, 24  # running sums; a triangular fill; a strided copy
STRIDED_DIMS = 4  # sizes c[3..6], strides c[7..10]
KINDS = {BINARY: 2, FLOAT_BINARY: 5, FLOAT_UNARY: 13, FLOAT_SCALAR: 8}
"""The largest kind (``c[4]``, ``c[3]`` for unary and scalar ops) each opcode's runner knows."""
DTYPES = (F32, I8)
SIZES = (4, 1)
MAX_VERDICTS = 1024


@functools.cache
def memory_bytes() -> int:
    """Physical memory: a workspace larger than this would fail to allocate inside C++,
    which aborts the process (``std::bad_alloc`` through an ``extern "C"`` frame)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40


@dataclass(frozen=True)
class Slot:
    """One slot: dtype code, owner slot, byte offset ``off0 + off1 s``, cols, row stride,
    rows ``rows0 + rows1 s``."""

    dtype: int
    owner: int
    off0: int
    off1: int
    cols: int
    ld: int
    rows0: int
    rows1: int

    @property
    def size(self) -> int:
        return SIZES[self.dtype]


@dataclass(frozen=True)
class Verdict:
    """What a call must still check: the constants' dtypes and sizes, the slots of the
    inputs and outputs, the workspace's bytes ``ws0 + ws1 s``."""

    consts: tuple[tuple[int, torch.dtype, int], ...]
    slots: tuple[Slot, ...]
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    ws0: int
    ws1: int


class VerdictMemo:
    """A bounded memo of table verdicts, oldest dropped first. Not a table of behaviour:
    dropping an entry changes no result, only its cost. Each entry holds the tensors its
    verdict was computed from, so the ids in its key cannot be taken by other tensors while
    it lives (a key of ids alone could match a new table at a dead one's address)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[tuple, tuple[Verdict, tuple[Tensor, ...]]] = OrderedDict()

    def get(self, key: tuple) -> Verdict | None:
        hit = self.entries.get(key)
        return None if hit is None else hit[0]

    def put(self, key: tuple, verdict: Verdict, tables: tuple[Tensor, ...]) -> Verdict:
        self.entries[key] = (verdict, tables)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return verdict


_VERDICTS = VerdictMemo(MAX_VERDICTS)


def stamp(t: Tensor) -> tuple:
    return (id(t), t._version, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def table(op: str, name: str, t: Tensor, dtype: torch.dtype, cols: Sequence[int]) -> list:
    """A 2-d (or, with ``cols`` empty, 1-d) contiguous table as Python lists."""
    ok = t.dtype == dtype and t.is_contiguous() and t.dim() == (2 if cols else 1)
    if not ok or (cols and t.shape[1] not in cols):
        raise fail(
            op, f"{name} is {t.dtype} {tuple(t.shape)}, expected a dense {dtype} table"
            + (f" of {' or '.join(map(str, cols))} columns" if cols else "")
        )  # fmt: skip
    return t.tolist()


def parse_slots(op: str, rows: list, fields: int) -> list[Slot]:
    """Slot records of 5 (cell loop: rows are the batch), 6 (static) or 8 (dynamic) fields."""
    slots = []
    for i, d in enumerate(rows):
        if not all(-LIMIT < v < LIMIT for v in d):
            raise fail(op, f"slot {i} has a field out of range: {d}")
        if fields == 5:
            slot = Slot(d[0], d[1], d[2], 0, d[3], d[4], 0, 1)
        elif fields == 6:
            slot = Slot(d[0], d[1], d[2], 0, d[3], d[4], d[5], 0)
        else:
            slot = Slot(d[0], d[1], d[2], d[7], d[3], d[4], d[5], d[6])
        if slot.owner == i:  # an owner starts its own storage: the offset is not read
            slot = Slot(slot.dtype, i, 0, 0, slot.cols, slot.ld, slot.rows0, slot.rows1)
            if slot.ld != slot.cols:  # lowering lays owners out dense (views have strides)
                raise fail(
                    op,
                    f"slot {i} owns its storage with a row stride of {slot.ld} for {slot.cols} "
                    "columns; an owner's rows are dense",
                )
        slots.append(slot)
    for i, s in enumerate(slots):
        if s.dtype not in (0, 1):
            raise fail(op, f"slot {i} has dtype code {s.dtype} (0 float32, 1 int8)")
        if min(s.off0, s.off1, s.cols, s.ld, s.rows0, s.rows1) < 0:
            raise fail(op, f"slot {i} has a negative size or offset")
        if not 0 <= s.owner <= i or slots[s.owner].owner != s.owner:
            raise fail(op, f"slot {i} is a view of slot {s.owner}, which is no earlier owner")
        inside(op, i, s, slots[s.owner])
    return slots


def inside(op: str, i: int, s: Slot, owner: Slot) -> None:
    """Every byte slot ``i`` reaches, ``off + ((rows - 1) ld + cols) size``, is inside its
    owner's ``rows ld size`` for every ``s >= 0`` at which it has rows."""
    if s.rows0 == s.rows1 == 0:
        return
    first = 0 if s.rows0 > 0 else -(-(1 - s.rows0) // s.rows1)  # smallest s with rows >= 1
    slope = owner.rows1 * owner.ld * owner.size - s.off1 - s.rows1 * s.ld * s.size
    at_first = (
        (owner.rows0 + owner.rows1 * first) * owner.ld * owner.size
        - (s.off0 + s.off1 * first)
        - ((s.rows0 + s.rows1 * first - 1) * s.ld + s.cols) * s.size
    )
    if slope < 0 or at_first < 0:
        raise fail(op, f"slot {i} reaches past the storage of its owner, slot {s.owner}")


def covers(a: Slot, b: Slot) -> bool:
    """``a`` has at least ``b``'s rows for every ``s >= 0``."""
    return a.rows0 >= b.rows0 and a.rows1 >= b.rows1


def instructions(op: str, code: list, fcode: list, slots: list[Slot], n_consts: int,
                 program: bool) -> tuple[dict[int, tuple[torch.dtype, int]], int, int]:  # fmt: skip
    """Check every instruction against ``run_op``; returns what each constant must be
    (dtype, least size) and the linear scratch's bytes (``a + b s``)."""
    if len(fcode) < len(code):
        raise fail(op, f"{len(code)} instructions but {len(fcode)} rows of float fields")
    need: dict[int, tuple[torch.dtype, int]] = {}
    scratch0 = scratch1 = 0

    def slot(n: int, field: int, c: list) -> Slot:
        if not 0 <= c[field] < len(slots):
            raise fail(op, f"instruction {n} names slot {c[field]} of {len(slots)}")
        return slots[c[field]]

    def const(n: int, index: int, dtype: torch.dtype, size: int, optional: bool = False) -> None:
        if optional and index == -1:
            return
        if not 0 <= index < n_consts:
            raise fail(op, f"instruction {n} names constant {index} of {n_consts}")
        old = need.get(index)
        if old is not None and old[0] != dtype:
            raise fail(op, f"constant {index} is read as {old[0]} and as {dtype}")
        need[index] = (dtype, max(size, old[1] if old else 0))

    def expect(n: int, what: str, ok: bool) -> None:
        if not ok:
            raise fail(op, f"instruction {n} (opcode {code[n][0]}): {what}")

    for n, c in enumerate(code):
        f = fcode[n]
        kind = c[0]
        dst, a = slot(n, 1, c), slot(n, 2, c)
        if kind in (LINEAR, LINEAR16):  # c[3] weight, c[4] scale, c[5] bias or -1, c[6] offset
            wide = kind == LINEAR16  # float rows split into two int8 planes, float out
            rows_n, kp = c[8], c[9]
            expect(n, "N and Kp out of range", 0 <= rows_n < LIMIT and 0 <= kp < LIMIT)
            expect(n, "Kp is not a multiple of 4 covering the input", kp % 4 == 0 and kp >= a.cols)
            expect(n, "reads the wrong input dtype", a.dtype == (0 if wide else 1))
            out_dtype = 1 if f[0] > 0 and not wide else 0
            expect(n, "writes the wrong dtype", dst.dtype == out_dtype)
            expect(
                n,
                "output narrower or shorter than N x input rows",
                dst.cols >= rows_n and covers(dst, a),
            )
            const(n, c[3], I8, -(-rows_n // 16) * 16 * kp)
            const(n, c[4], F32, rows_n)
            const(n, c[5], F32, rows_n, optional=True)
            const(n, c[6], I32, rows_n)
            if program and f[0] > 0 and not wide:  # program.cpp: multipliers, then additions
                const(n, c[11], F32, 2 * rows_n)
            planes = 2 if wide else 1
            scratch0 += planes * a.rows0 * (kp + 4)
            scratch1 += planes * a.rows1 * (kp + 4)
            continue
        if kind in (MATMUL, FLOAT_MATMUL):
            matmul(n, kind, f, a, slot(n, 3, c), dst, c[4], expect)
            continue
        if kind == ATTENTION:
            expect(n, "attention runs in region programs only", program)
            mask = None if c[5] == -1 else slot(n, 5, c)
            attention(n, c, a, slot(n, 3, c), slot(n, 4, c), mask, dst, expect)
            continue
        if kind == TRANSPOSE:
            transpose(n, a, dst, c[3], expect)
            continue
        if kind in (CUMSUM, TRI_FILL):
            blocks(n, kind, c, a, dst, expect)
            continue
        if kind == STRIDED:
            strided(n, c, a, dst, slots[a.owner], expect)
            continue
        if kind == ROW_SUM:
            expect(n, "wrong operand or result dtype", a.dtype == dst.dtype == 0)
            expect(n, "the result is not one value per row of the source",
                   dst.cols >= 1 and covers(a, dst) and covers(dst, a))  # fmt: skip
            continue
        sources = [a]
        if kind in (BINARY, FLOAT_BINARY):
            b = slot(n, 3, c)
            expect(n, "kind out of range", 0 <= c[4] <= KINDS[kind])
            one = kind == BINARY and c[5] == 1  # b is one value, read for every element
            # one value per row: b (FLOAT_BINARY 1, BINARY 2) or a (FLOAT_BINARY 2, BINARY 3)
            b_col = c[5] == (1 if kind == FLOAT_BINARY else 2)
            a_col = c[5] == (2 if kind == FLOAT_BINARY else 3)
            column = b_col or a_col
            # one float value for every row: b (FLOAT_BINARY 3) or a (FLOAT_BINARY 4)
            one_f = kind == FLOAT_BINARY and c[5] in (3, 4)
            flag_ok = c[5] in (0, 1, 2, 3, 4) and (c[5] == 0 or one or column or one_f)
            expect(n, "operand flag out of range", flag_ok)
            if one:
                expect(n, "b is not one int8 value", b.dtype == 1 and min(b.rows0, b.cols) >= 1)
            elif one_f:
                value = b if c[5] == 3 else a
                sources = [a if c[5] == 3 else b]
                ok = value.dtype == 0 and min(value.rows0, value.cols) >= 1
                expect(n, "the one-value operand is not one float value", ok)
            elif column:
                col = b if b_col else a
                sources = [a if b_col else b]
                dtype = 0 if kind == FLOAT_BINARY else 1
                ok = col.dtype == dtype and col.cols >= 1 and covers(col, dst)
                expect(n, "the column operand is not a value per row of the result", ok)
            else:
                sources.append(b)
        for src in sources:
            expect(n, "a source has fewer rows than the result", covers(src, dst))
            wide = (
                src.cols * src.size >= dst.cols * dst.size if kind == COPY else src.cols >= dst.cols
            )
            expect(n, "a source row is narrower than the result's", wide)  # COPY: bytes
        if kind == COPY:
            continue
        floats = (FAKE_QUANT, FLOAT_BINARY, FLOAT_UNARY, FLOAT_SCALAR, NORM, RMS_NORM)
        float_in = kind in (QUANT, *floats)
        float_out = kind in (DEQUANT, *floats)
        if kind not in (QUANT, DEQUANT, BINARY, LOOKUP) and not float_in:
            raise fail(op, f"instruction {n} has opcode {kind}, which no runner knows")
        expect(n, "wrong operand dtype", all(s.dtype == (0 if float_in else 1) for s in sources))
        expect(n, "wrong result dtype", dst.dtype == (0 if float_out else 1))
        if kind == LOOKUP:
            const(n, c[3], I8, 256)
        elif kind in (FLOAT_UNARY, FLOAT_SCALAR):
            expect(n, "kind out of range", 0 <= c[3] <= KINDS[kind])
            expect(n, "vector flag out of range", kind == FLOAT_SCALAR or c[4] in (0, 1))
        elif kind == NORM:
            const(n, c[3], F32, dst.cols, optional=True)
            const(n, c[4], F32, dst.cols, optional=True)
            expect(n, "vector flag out of range", c[5] in (0, 1))
        elif kind == RMS_NORM:
            const(n, c[3], F32, dst.cols, optional=True)
    return need, scratch0, scratch1


def matmul(n: int, kind: int, f: list, a: Slot, b: Slot, d: Slot, m: int, expect: Any) -> None:
    """A batched ``a @ b``: dense [batch M, K] @ [batch K, N] -> [batch M, N], for every
    size (``a`` has a multiple of ``m`` rows, ``b`` K rows per batch, ``d`` ``a``'s rows)."""
    expect(n, "M out of range", 1 <= m < LIMIT and a.cols < LIMIT and b.cols < LIMIT)
    expect(n, "an operand is not dense", all(s.ld == s.cols for s in (a, b, d)))
    expect(n, "rows are not a whole number of batches", a.rows0 % m == 0 and a.rows1 % m == 0)
    batches = (a.rows0 // m, a.rows1 // m)
    expect(n, "b's rows are not K per batch", (b.rows0, b.rows1) == (batches[0] * a.cols,
           batches[1] * a.cols))  # fmt: skip
    expect(n, "the result's shape is not [batch M, N]",
           (d.rows0, d.rows1, d.cols) == (a.rows0, a.rows1, b.cols))  # fmt: skip
    quantized = kind == MATMUL
    out = 1 if quantized and f[3] > 0 else 0
    expect(n, "wrong operand or result dtype",
           a.dtype == b.dtype == int(quantized) and d.dtype == out)  # fmt: skip


def attention(n: int, c: list, q: Slot, k: Slot, v: Slot, mask: Slot | None, d: Slot,
              expect: Any) -> None:  # fmt: skip
    """``ATTENTION`` (``qt_program.h``): q ``[B Sq, >= H D]``, k ``[B Sk, >= H D]``, v
    ``[B Sk, >= H Dv]``, the result ``[B Sq, >= H Dv]``, all float, for every size; the mask
    float ``[rows, >= Sk]`` with one row per batch (``c[9]`` 0), one for all (1) or ``Sq``
    per batch (2). The result is an owner of its own, so it overlaps none of them."""
    heads, sq, sk, dk, dv = c[6], c[7], c[8], c[10], c[11]
    sizes = (heads, sq, sk, dk, dv)
    expect(n, "heads, rows or features out of range", all(1 <= x < LIMIT for x in sizes))
    expect(n, "an operand or the result is not float",
           all(s.dtype == 0 for s in (q, k, v, d, *([mask] if mask else []))))  # fmt: skip
    whole = q.rows0 % sq == 0 and q.rows1 % sq == 0
    expect(n, "q's rows are not a whole number of batches of Sq", whole)
    batches = (q.rows0 // sq, q.rows1 // sq)
    keys = (batches[0] * sk, batches[1] * sk)
    expect(n, "k's or v's rows are not Sk per batch", (k.rows0, k.rows1) == (v.rows0, v.rows1)
           == keys)  # fmt: skip
    expect(n, "q or k narrower than H D, v than H Dv", min(q.cols, k.cols) >= heads * dk
           and v.cols >= heads * dv)  # fmt: skip
    expect(n, "the result is not q's rows of H Dv columns, or not an owner",
           (d.rows0, d.rows1) == (q.rows0, q.rows1) and d.cols >= heads * dv and d.ld == d.cols
           and d.owner not in (q.owner, k.owner, v.owner))  # fmt: skip
    if mask is None:
        return
    rows = {0: batches, 1: (1, 0), 2: (q.rows0, q.rows1)}.get(c[9])
    expect(n, "mask row flag out of range", rows is not None)
    expect(n, "the mask is narrower than Sk or has fewer rows than its flag reads",
           mask.cols >= sk and rows is not None and mask.rows0 >= rows[0]
           and mask.rows1 >= rows[1])  # fmt: skip


def transpose(n: int, a: Slot, d: Slot, r: int, expect: Any) -> None:
    """Each batch's ``[r, C]`` rows of ``a`` as ``[C, r]`` in ``d``: ``a`` a whole number of
    batches, ``d`` ``C`` rows of ``r`` values per batch, one dtype."""
    expect(n, "R out of range", 1 <= r < LIMIT)
    expect(n, "rows are not a whole number of batches", a.rows0 % r == 0 and a.rows1 % r == 0)
    rows = (a.rows0 // r * a.cols, a.rows1 // r * a.cols)
    expect(n, "the result's shape is not [batch C, R]", (d.rows0, d.rows1) == rows and d.cols == r)
    expect(n, "wrong operand or result dtype", a.dtype == d.dtype)


def blocks(n: int, kind: int, c: list, a: Slot, d: Slot, expect: Any) -> None:
    """``CUMSUM`` (``c[3]`` 0: along rows, else down blocks of ``c[3]`` rows) and ``TRI_FILL``
    (blocks of ``c[3] >= 1`` rows, diagonal offset ``c[4]``): float ``a`` at least as wide as
    ``d`` and with its rows, the rows a whole number of blocks."""
    lowest = 0 if kind == CUMSUM else 1
    expect(n, "block rows out of range", lowest <= c[3] < LIMIT)
    expect(n, "wrong operand or result dtype", a.dtype == d.dtype == 0)
    expect(n, "the source is narrower or shorter than the result",
           a.cols >= d.cols and covers(a, d))  # fmt: skip
    if c[3]:
        expect(n, "rows are not a whole number of blocks", d.rows0 % c[3] == 0
               and d.rows1 % c[3] == 0)  # fmt: skip
    if kind == TRI_FILL:
        expect(n, "diagonal offset out of range", -LIMIT < c[4] < LIMIT)


def strided(n: int, c: list, a: Slot, d: Slot, owner: Slot, expect: Any) -> None:
    """``STRIDED``: ``d`` a dense static owner of exactly the sizes' product elements, of
    ``a``'s dtype; every element the sizes and strides reach from ``a``'s first one inside
    ``a``'s owner (a static view: the reach is ``a``'s offset plus the largest index)."""
    sizes, steps = c[3 : 3 + STRIDED_DIMS], c[7 : 7 + STRIDED_DIMS]
    expect(n, "sizes or strides out of range",
           all(1 <= x < LIMIT for x in sizes) and all(0 <= x < LIMIT for x in steps))  # fmt: skip
    expect(n, "a static operand and result only", a.rows1 == a.off1 == d.rows1 == d.off1 == 0
           and owner.rows1 == 0)  # fmt: skip
    expect(n, "the result is not a dense owner", d.ld == d.cols and d.owner != a.owner)
    total = 1
    for x in sizes:
        total *= x
    expect(n, "the result does not hold the sizes' elements", d.rows0 * d.cols == total)
    expect(n, "wrong operand or result dtype", a.dtype == d.dtype)
    reach = sum((x - 1) * y for x, y in zip(sizes, steps, strict=True))
    room = owner.rows0 * owner.ld * owner.size - a.off0
    expect(n, "the strides reach past the operand's storage", (reach + 1) * a.size <= room)


def workspace(slots: list[Slot]) -> tuple[int, int]:
    """The workspace's bytes as ``a + b s`` (owners rounded up to 64 bytes, plus 64)."""
    owners = [s for i, s in enumerate(slots) if s.owner == i]
    ws0 = sum(s.rows0 * s.ld * s.size + 63 for s in owners) + 64
    return ws0, sum(s.rows1 * s.ld * s.size for s in owners)


def remember(key: tuple, verdict: Verdict, tables: tuple[Tensor, ...]) -> Verdict:
    return _VERDICTS.put(key, verdict, tables)


WORKSPACE_FLOOR = 64 << 20
"""Bytes of workspace any program may lay out, whatever it reads and writes."""
WORKSPACE_FACTOR = 64
"""Above the floor, a workspace is at most this many times the bytes of the tensors its call
reads and writes (inputs, states, outputs, constants): a program's intermediates are
values computed from those, a few of each. A table entry larger than the program needs (a
row stride, a width or a row count of 2**31 - 1 in a 9 KB file) would otherwise make the
kernel allocate gigabytes. ``QUANTREE_NATIVE_WORKSPACE_FACTOR`` sets another factor."""


def workspace_factor() -> float:
    raw = os.environ.get("QUANTREE_NATIVE_WORKSPACE_FACTOR", "")
    try:
        return float(raw) if raw else WORKSPACE_FACTOR
    except ValueError:
        raise fail("program", f"QUANTREE_NATIVE_WORKSPACE_FACTOR={raw!r} is not a number") from None


def call(op: str, verdict: Verdict, size: int, consts: Sequence[Tensor], io_bytes: int = 0) -> None:
    """What one call adds: the constants as the instructions read them, and a workspace
    this machine can allocate and the call's tensors (``io_bytes`` besides the constants)
    account for (``WORKSPACE_FACTOR``)."""
    if not 0 <= size < LIMIT:
        raise fail(op, f"size symbol {size} out of range")
    for index, dtype, least in verdict.consts:
        t = consts[index]
        if t.dtype != dtype or t.numel() < least:
            raise fail(
                op, f"constant {index} is {t.dtype} of {t.numel()} values, read as {least} {dtype}"
            )
    ws = verdict.ws0 + verdict.ws1 * size
    if ws > WORKSPACE_FLOOR:
        workspace_bound(op, ws, size, io_bytes + sum(t.numel() * t.element_size() for t in consts))


def workspace_bound(op: str, ws: int, size: int, held: int) -> None:
    """A workspace of ``ws`` bytes this machine can allocate and ``held`` bytes of the call's
    tensors account for (``WORKSPACE_FACTOR``)."""
    if ws > memory_bytes():
        raise fail(op, f"the workspace for size {size} would exceed this machine's memory")
    factor = workspace_factor()
    if ws > WORKSPACE_FLOOR and ws > factor * held:
        raise fail(
            op,
            f"the workspace for size {size} is {ws} bytes, over {factor:g} times the "
            f"{held} bytes of the tensors the call reads and writes: a table entry (a "
            "row stride, a width, a row count) is larger than the program needs (set "
            "QUANTREE_NATIVE_WORKSPACE_FACTOR for a program that does need it)",
        )


def rows_at(s: Slot, size: int) -> int:
    return s.rows0 + s.rows1 * size


# void qt_program_run(void** inputs, const int64_t* in_slots, int64_t n_in, void** outputs,
#     const int64_t* out_slots, int64_t n_out, const int64_t* slots, int64_t n_slots,
#     int64_t fields, int64_t size, const int64_t* code, const float* fcode, int64_t n_code,
#     void** consts)
def program(inputs: Sequence[Tensor], consts: Sequence[Tensor], code: Tensor, fcode: Tensor,
            slots: Tensor, in_slots: Tensor, out_slots: Tensor, out_dtypes: Sequence[int],
            size: int, outs: Sequence[Tensor]) -> None:  # fmt: skip
    """A region program's call: tables checked once (cached), then the inputs copied in
    (dense, ``rows(s) x cols`` of their slot's dtype) and the outputs copied out."""
    op = "program"
    tables = (code, fcode, slots, in_slots, out_slots)
    key = ("program", *map(stamp, tables), tuple(out_dtypes), len(inputs), len(consts))
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = program_verdict(*tables, out_dtypes, len(inputs), len(consts))
        remember(key, verdict, tables)
    io_bytes = sum(t.numel() * t.element_size() for t in (*inputs, *outs))
    call(op, verdict, size, consts, io_bytes)
    for name, tensors, which in (("input", inputs, verdict.ins), ("output", outs, verdict.outs)):
        for i, (t, index) in enumerate(zip(tensors, which, strict=True)):
            s = verdict.slots[index]
            if t.dtype != DTYPES[s.dtype] or t.numel() != rows_at(s, size) * s.cols:
                raise fail(
                    op,
                    f"{name} {i} is {t.dtype} {tuple(t.shape)}; its slot {index} holds "
                    f"{rows_at(s, size)} x {s.cols} {DTYPES[s.dtype]}",
                )


def program_verdict(code: Tensor, fcode: Tensor, slots: Tensor, in_slots: Tensor,
                    out_slots: Tensor, out_dtypes: Sequence[int], n_in: int,
                    n_consts: int) -> Verdict:  # fmt: skip
    op = "program"
    table_slots = parse_slots(op, table(op, "slots", slots, I64, (6, 8)), int(slots.shape[1]))
    ins, outs = table(op, "in_slots", in_slots, I64, ()), table(op, "out_slots", out_slots, I64, ())
    if len(ins) < n_in or len(outs) < len(out_dtypes):
        raise fail(
            op, f"{len(ins)} input / {len(outs)} output slots for {n_in} / {len(out_dtypes)}"
        )
    for name, indices in (("input", ins), ("output", outs)):
        for i in indices:
            if not 0 <= i < len(table_slots):
                raise fail(op, f"{name} slot {i} of {len(table_slots)}")
    for i, (d, index) in enumerate(zip(out_dtypes, outs, strict=False)):
        if d not in (0, 1) or table_slots[index].dtype != d:
            raise fail(op, f"output {i} has dtype code {d}, its slot {index} another")
    code_rows = table(op, "code", code, I64, (NI,))
    fcode_rows = table(op, "fcode", fcode, F32, (NF,))
    need, scratch0, scratch1 = instructions(op, code_rows, fcode_rows, table_slots, n_consts, True)
    ws0, ws1 = workspace(table_slots)
    return Verdict(
        tuple((i, d, n) for i, (d, n) in sorted(need.items())), tuple(table_slots),
        tuple(ins[:n_in]), tuple(outs[: len(out_dtypes)]), ws0 + scratch0, ws1 + scratch1,
    )  # fmt: skip


# void qt_cell_loop(const float* xs, float* ys, int64_t T, int reverse, float** states,
#     int64_t n_states, const int64_t* outs, const int64_t* slots, int64_t n_slots, int64_t B,
#     const int64_t* code, const float* fcode, int64_t n_code, void** consts)
def cell_loop(n_states: int, consts: Sequence[Tensor], code: Tensor, fcode: Tensor,
              slots: Tensor, outs: Tensor, batch: int, io_bytes: int = 0) -> Verdict:  # fmt: skip
    """A cell loop's call: slot 0 the float input, slots ``1..n_states`` the float states,
    ``outs[k]`` float slots at least as wide as state ``k`` (``outs[0]`` exactly: it is
    also the output row); the caller checks the inputs' widths against the slots'.
    ``io_bytes``: the float bytes of the input and states (``call``)."""
    tables = (code, fcode, slots, outs)
    key = ("cell_loop", *map(stamp, tables), n_states, len(consts))
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = cell_verdict(n_states, len(consts), *tables)
        remember(key, verdict, tables)
    call("cell_loop", verdict, batch, consts, io_bytes)
    return verdict


def cell_verdict(n_states: int, n_consts: int, code: Tensor, fcode: Tensor, slots: Tensor,
                 outs: Tensor) -> Verdict:  # fmt: skip
    op = "cell_loop"
    table_slots = parse_slots(op, table(op, "slots", slots, I64, (5,)), 5)
    out_rows = table(op, "outs", outs, I64, ())
    if n_states < 1 or len(table_slots) < 1 + n_states or len(out_rows) < n_states:
        raise fail(op, f"{n_states} states, {len(table_slots)} slots, {len(out_rows)} outs")
    for k in range(1 + n_states):
        if table_slots[k].dtype != 0:
            raise fail(op, f"slot {k} (the input or a state) is not float")
    for k, index in enumerate(out_rows[:n_states]):
        if not 0 <= index < len(table_slots):
            raise fail(op, f"out {k} names slot {index} of {len(table_slots)}")
        s, state = table_slots[index], table_slots[1 + k]
        if s.dtype != 0 or s.cols < state.cols or (k == 0 and s.cols != state.cols):
            raise fail(op, f"out {k} (slot {index}) does not fit state {k}")
    code_rows = table(op, "code", code, I64, (NI,))
    fcode_rows = table(op, "fcode", fcode, F32, (NF,))
    need, scratch0, scratch1 = instructions(op, code_rows, fcode_rows, table_slots, n_consts, False)
    ws0, ws1 = workspace(table_slots)
    return Verdict(
        tuple((i, d, n) for i, (d, n) in sorted(need.items())), tuple(table_slots), (), (),
        ws0 + scratch0, ws1 + scratch1,
    )  # fmt: skip


def symbol(inputs: Sequence[Tensor], sym: Sequence[int]) -> None:
    """``sym`` (``[input, dim, a, b]``: that dimension is ``a + b s``) names a dimension of
    an input, with ``a >= 0`` and ``b >= 1``; or is empty (a static program)."""
    if not sym:
        return
    ok = len(sym) == 4 and 0 <= sym[0] < len(inputs) and sym[2] >= 0 and sym[3] >= 1
    if not ok or not -inputs[sym[0]].dim() <= sym[1] < inputs[sym[0]].dim():
        raise fail("program", f"size symbol {list(sym)} names no dimension of the inputs")


def loop_roles(n_in: int, stepped: Sequence[int], feed: Sequence[int], n_out: int) -> None:
    """A folded loop's roles (``quantree.program_loop``): one 0/1 per input, at least one
    per-step input, and per output the input it feeds next step (``f >= 0``; ``f <= -2``
    feeds input ``-f - 2`` and keeps the last step only), never a per-step one nor an input
    twice, or -1. Checked when a file loads and at each call, before the tables."""
    op = "program_loop"
    if len(stepped) != n_in or any(s not in (0, 1) for s in stepped) or not any(stepped):
        raise fail(op, f"stepped {list(stepped)}: one 0 or 1 per input, at least one 1 "
                   "(per-step inputs)")  # fmt: skip
    if len(feed) != n_out or any(not -n_in - 2 < f < n_in for f in feed):
        raise fail(op, f"feed {list(feed)}: one input index, -1, or -2 - index per output")
    fed = [f if f >= 0 else -f - 2 for f in feed if f != -1]
    if len(set(fed)) != len(fed) or any(stepped[f] for f in fed):
        raise fail(op, "feed names an input twice, or a per-step one")


def check_graph(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Verdict]]:
    """Check now the tables (and a folded loop's roles) of every region program, folded loop
    and cell loop of ``gm`` that reads them from constants (a loaded model's), so that a bad
    table is refused when the file loads (``serialize.load``), not at the first call; the
    verdicts are cached for those calls.
    Returns each checked node with its verdict (``table_needs`` bounds them further)."""
    quantree = torch.ops.quantree
    checked: list[tuple[torch.fx.Node, Verdict]] = []
    for node in gm.graph.nodes:
        target = node.target
        if not isinstance(target, OpOverload):
            target = getattr(target, "op", target)  # a DirectCall's op
        tabled = (quantree.program.default, quantree.program_loop.default,
                  quantree.cell_loop.default, quantree.cell_loop_packed.default)  # fmt: skip
        if target not in tabled:
            continue
        normalized = normalize_function(
            target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
        )
        if normalized is None:
            continue
        a: dict[str, Any] = {k: constant(gm, v) for k, v in normalized.kwargs.items()}
        consts = a["consts"] if isinstance(a["consts"], list) else []
        if target in (quantree.program.default, quantree.program_loop.default):
            tables = tuple(a[k] for k in ("code", "fcode", "slots", "in_slots", "out_slots"))
            if target == quantree.program_loop.default:
                loop_roles(len(a["inputs"]), a["stepped"], a["feed"], len(a["out_dtypes"]))
            if all(isinstance(t, Tensor) for t in tables):
                n_in, dtypes = len(a["inputs"]), tuple(a["out_dtypes"])
                code, fcode, slots, ins, outs = tables
                verdict = program_verdict(code, fcode, slots, ins, outs, dtypes, n_in, len(consts))
                key = ("program", *map(stamp, tables), dtypes, n_in, len(consts))
                remember(key, verdict, tables)
                remember_constants("program", verdict, consts)
                checked.append((node, verdict))
        else:
            tables = tuple(a[k] for k in ("code", "fcode", "slots", "outs"))
            if all(isinstance(t, Tensor) for t in tables):
                n_states = len(a["state"])
                verdict = cell_verdict(n_states, len(consts), *tables)
                key = ("cell_loop", *map(stamp, tables), n_states, len(consts))
                remember(key, verdict, tables)
                remember_constants("cell_loop", verdict, consts)
                checked.append((node, verdict))
    return checked


def constant(gm: torch.fx.GraphModule, value: object) -> object:
    """A ``get_attr`` node's tensor, a list of them, or the value (a graph input: None)."""
    if isinstance(value, list | tuple):
        return [constant(gm, v) for v in value]
    if isinstance(value, torch.fx.Node):
        if value.op != "get_attr":
            return None
        target: object = gm
        for name in str(value.target).split("."):
            target = getattr(target, name)
        return target
    return value


def remember_constants(op: str, verdict: Verdict, consts: Sequence[object]) -> None:
    """The constants' part of a call's checks, for the constants that are in the graph."""
    for index, dtype, least in verdict.consts:
        t = consts[index]
        if isinstance(t, Tensor) and (t.dtype != dtype or t.numel() < least):
            raise fail(
                op, f"constant {index} is {t.dtype} of {t.numel()} values, read as {least} {dtype}"
            )
