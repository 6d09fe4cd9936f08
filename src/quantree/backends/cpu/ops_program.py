"""``quantree.program``: a straight-line region of lowered ops run in one native call.

The region's values live in one workspace laid out for the shapes it was compiled for
(``lowering_program``); ``code``, ``fcode`` and ``slots`` are its instructions
(``csrc/qt_program.h``) and value table, ``consts`` the tensors they read. Inputs are copied
in, outputs out, in the dtypes and shapes recorded at compile time.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from quantree.backends.cpu.native import library, ptr
from quantree.backends.cpu.registry import op

DTYPES = (torch.float32, torch.int8)
"""Slot dtype codes: 0 float32, 1 int8."""


def _shapes(flat: list[int], ranks: list[int]) -> list[list[int]]:
    shapes, i = [], 0
    for rank in ranks:
        shapes.append(list(flat[i : i + rank]))
        i += rank
    return shapes


@op(
    "program(Tensor[] inputs, Tensor[] consts, Tensor code, Tensor fcode, Tensor slots, "
    "Tensor in_slots, Tensor out_slots, int[] in_shapes, int[] in_ranks, int[] out_shapes, "
    "int[] out_ranks, int[] out_dtypes) -> Tensor[]"
)
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
) -> list[Tensor]:
    """The region's outputs for ``inputs``, which must have the compiled shapes."""
    expected = _shapes(in_shapes, in_ranks)
    if [list(x.shape) for x in inputs] != expected:
        raise ValueError(
            "a quantree region program was compiled for inputs of shapes "
            f"{expected}, got {[list(x.shape) for x in inputs]}: lower the model again with "
            "example inputs of these shapes"
        )
    dense = [x.contiguous() for x in inputs]
    outs = [
        torch.empty(shape, dtype=DTYPES[d])
        for shape, d in zip(_shapes(out_shapes, out_ranks), out_dtypes, strict=True)
    ]
    void_p = ctypes.c_void_p
    library().qt_program_run(
        (void_p * max(len(dense), 1))(*[ptr(x) for x in dense]), ptr(in_slots), len(dense),
        (void_p * max(len(outs), 1))(*[ptr(o) for o in outs]), ptr(out_slots), len(outs),
        ptr(slots), slots.shape[0], ptr(code), ptr(fcode), code.shape[0],
        (void_p * max(len(consts), 1))(*[ptr(c) for c in consts]),
    )  # fmt: skip
    return outs


@torch.library.register_fake("quantree::program")
def _(inputs, consts, code, fcode, slots, in_slots, out_slots, in_shapes, in_ranks, out_shapes,
      out_ranks, out_dtypes):  # fmt: skip
    expected = _shapes(in_shapes, in_ranks)
    if [list(x.shape) for x in inputs] != expected:  # a dynamic batch: the shapes are fixed
        raise ValueError(f"a quantree region program runs on inputs of shapes {expected} only")
    return [
        torch.empty(shape, dtype=DTYPES[d])
        for shape, d in zip(_shapes(out_shapes, out_ranks), out_dtypes, strict=True)
    ]
