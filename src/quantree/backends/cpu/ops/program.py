"""``quantree.program``: a straight-line region of lowered ops run in one native call.

The region's values live in one workspace laid out per call (``passes/regions.py``);
``code``, ``fcode`` and ``slots`` are its instructions (``csrc/qt_program.h``) and value
table, ``consts`` the tensors they read. Inputs are copied in, outputs out, in the dtypes
and shapes recorded at compile time, a dynamic program's sizes resolved from its inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quantree.backends.cpu.native import program_checks
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.checks import fail
from quantree.backends.cpu.native.loader import I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op

SIGNATURES: dict[str, list[type]] = {
    "qt_program_run": [
        *(PTR, PTR, I64, PTR, PTR, I64, PTR, I64, I64, I64, PTR, PTR, I64, PTR)
    ],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

DTYPES = (torch.float32, torch.int8)
"""Slot dtype codes: 0 float32, 1 int8."""


def _shapes(flat: list[int], ranks: list[int]) -> list[list[int]]:
    shapes, i = [], 0
    for rank in ranks:
        shapes.append(list(flat[i : i + rank]))
        i += rank
    return shapes


def _size(inputs: list[Tensor], sym: list[int]) -> Any:
    """The program's size symbol for these inputs (1 for a static program). ``sym`` is
    ``[input, dim, a, b]``: that dimension is ``a + b * symbol``."""
    if not sym:
        return 1
    i, dim, a, b = sym
    size = inputs[i].shape[dim]
    if isinstance(size, int) and ((size - a) % b or size < a):
        raise ValueError(
            f"a quantree region program reads its batch from input {i}'s dimension {dim}, "
            f"which must be {a} + {b} * n; got {size}"
        )
    return (size - a) // b


def _resolve(flat: list[int], coeffs: list[int], size: Any) -> list[Any]:
    return [a + b * size if b else a for a, b in zip(flat, coeffs or [0] * len(flat), strict=True)]


SCHEMA = (
    "program(Tensor[] inputs, Tensor[] consts, Tensor code, Tensor fcode, Tensor slots, "
    "Tensor in_slots, Tensor out_slots, int[] in_shapes, int[] in_ranks, int[] out_shapes, "
    "int[] out_ranks, int[] out_dtypes, int[] in_coeffs=[], int[] out_coeffs=[], "
    "int[] sym=[]) -> Tensor[]"
)
"""``in_coeffs`` / ``out_coeffs`` / ``sym``: a dynamic program's sizes (each dimension
``shape + coeff * symbol``) and where its symbol is read; left out (saved models from before
them too), the program is static."""


@op(SCHEMA)
def program(
    inputs: list[Tensor],
    consts: list[Tensor],
    code: Tensor,
    fcode: Tensor,
    slots: Tensor,
    in_slots: Tensor,
    out_slots: Tensor,
    in_shapes: list[int],
    in_ranks: list[int],
    out_shapes: list[int],
    out_ranks: list[int],
    out_dtypes: list[int],
    in_coeffs: list[int] | None = None,
    out_coeffs: list[int] | None = None,
    sym: list[int] | None = None,
) -> list[Tensor]:
    """The region's outputs for ``inputs``, which must have the compiled shapes (a dynamic
    program's symbol resolved from ``inputs`` first)."""
    if any(d not in (0, 1) for d in out_dtypes):
        raise fail("program", f"out_dtypes {list(out_dtypes)}: each is a dtype code, 0 "
                   "(float32) or 1 (int8)")  # fmt: skip
    program_checks.symbol(inputs, sym or [])
    size = _size(inputs, sym or [])
    expected = _shapes(_resolve(in_shapes, in_coeffs or [], size), in_ranks)
    if [list(x.shape) for x in inputs] != expected:
        raise fail(
            "program",
            "compiled for inputs of shapes "
            f"{expected}, got {[list(x.shape) for x in inputs]}: lower the model again with "
            "example inputs of these shapes",
        )
    dense = [x.contiguous() for x in inputs]
    outs = [
        torch.empty(shape, dtype=DTYPES[d])
        for shape, d in zip(
            _shapes(_resolve(out_shapes, out_coeffs or [], size), out_ranks), out_dtypes,
            strict=True,
        )
    ]  # fmt: skip
    program_checks.program(
        dense, consts, code, fcode, slots, in_slots, out_slots, out_dtypes, size, outs
    )
    a = NativeArgs("program")  # every address below points into a tensor ``a`` holds
    kernels().qt_program_run(
        a.inputs("inputs", dense), a.input("in_slots", in_slots), len(dense),
        a.outputs("outputs", outs), a.input("out_slots", out_slots), len(outs),
        a.input("slots", slots), slots.shape[0], slots.shape[1], size, a.input("code", code),
        a.input("fcode", fcode), code.shape[0], a.inputs("consts", consts),
    )  # fmt: skip
    return outs


@torch.library.register_fake("quantree::program")
def _(inputs, consts, code, fcode, slots, in_slots, out_slots, in_shapes, in_ranks, out_shapes,
      out_ranks, out_dtypes, in_coeffs=(), out_coeffs=(), sym=()):  # fmt: skip
    size = _size(inputs, list(sym))
    expected = _shapes(_resolve(in_shapes, list(in_coeffs), size), in_ranks)
    if [list(x.shape) for x in inputs] != expected:  # shapes the program was not made for
        raise ValueError(f"a quantree region program runs on inputs of shapes {expected} only")
    return [
        torch.empty(shape, dtype=DTYPES[d])
        for shape, d in zip(
            _shapes(_resolve(out_shapes, list(out_coeffs), size), out_ranks),
            out_dtypes,
            strict=True,
        )
    ]


split_shapes, resolve, symbol_size = _shapes, _resolve, _size
"""The shape helpers a step loop's call shares (``cells/program_loop.py``)."""
