"""``quantree.program_loop``: a region program (``quantree.program``'s tables) run for every
time step of a folded loop in one native call (``csrc/program_loop.cpp``).

Inputs marked ``stepped`` are ``[T, *step shape]`` (step ``t`` reads row ``t``); the others
are read once, as ``quantree.program``'s. Every output comes back as ``[T, *step shape]``;
``feed[o] >= 0`` makes output ``o`` the next step's input ``feed[o]`` (a carried state),
so the final state is the output's last row; ``feed[o] <= -2`` carries it into input
``-feed[o] - 2`` and keeps the last step's value only (``[1, *shape]``: a state no step's
output collects, so ``T`` copies of it are never written).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from quantree.backends.cpu.native import program_checks
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.checks import fail
from quantree.backends.cpu.native.loader import I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op
from quantree.backends.cpu.ops.program import DTYPES
from quantree.backends.cpu.ops.program import resolve as _resolve
from quantree.backends.cpu.ops.program import split_shapes as _shapes
from quantree.backends.cpu.ops.program import symbol_size as _size

SIGNATURES: dict[str, list[type]] = {
    "qt_program_loop": [
        *(PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64, I64, PTR, I64, I64, I64, PTR, PTR, I64),
        PTR,
    ],
}  # fmt: skip
kernels = native_kernels(SIGNATURES)

SCHEMA = (
    "program_loop(Tensor[] inputs, Tensor[] consts, Tensor code, Tensor fcode, Tensor slots, "
    "Tensor in_slots, Tensor out_slots, int[] in_shapes, int[] in_ranks, int[] out_shapes, "
    "int[] out_ranks, int[] out_dtypes, int[] in_coeffs, int[] out_coeffs, int[] sym, "
    "int[] stepped, int[] feed) -> Tensor[]"
)


def _roles(inputs: list[Tensor], stepped: list[int], feed: list[int], n_out: int) -> int:
    """The number of steps; a ``QuantreeError`` naming the field where the roles are not
    ones the loop runs (a tampered or hand-made call)."""
    program_checks.loop_roles(len(inputs), stepped, feed, n_out)
    lengths = {int(x.shape[0]) for x, s in zip(inputs, stepped, strict=True) if s and x.dim()}
    if not any(stepped) or len(lengths) != 1 or min(lengths) < 1:
        shapes = [tuple(x.shape) for x, s in zip(inputs, stepped, strict=True) if s]
        raise fail(
            "program_loop",
            f"per-step inputs of shapes {shapes}: at least one, all as long (one step or more)",
        )
    return lengths.pop()


def row_stride(step: Tensor) -> int | None:
    """Elements from one row of a step's value to the next where its rows (every dimension
    but the last, merged) are evenly spaced and each row is dense: a ``[T, ...]`` view cut
    from another dimension of a tensor, read in place instead of copied."""
    if step.dim() < 2 or step.numel() == 0 or (step.stride(-1) != 1 and step.shape[-1] != 1):
        return None
    stride = None
    for size, st in zip(reversed(step.shape[:-1]), reversed(step.stride()[:-1]), strict=True):
        if size == 1:
            continue
        if stride is not None and st != stride:
            return None
        stride = st * size
    inner = [st for size, st in zip(step.shape[:-1], step.stride()[:-1], strict=True) if size > 1]
    return inner[-1] if inner else step.shape[-1]


def _fed(f: int) -> int:
    """The input an output with ``feed`` value ``f`` is carried into (-1: none)."""
    return -f - 2 if f <= -2 else f


def _steps_kept(f: int, steps: int) -> int:
    """Rows of an output's buffer: every step's, or the last one's (``feed`` <= -2)."""
    return 1 if f <= -2 else steps


@op(SCHEMA)
def program_loop(*args: Any) -> list[Tensor]:
    """Every step's outputs, ``[T, *shape]`` each."""
    return checked_loop(*args)[0]


def checked_loop(
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
    in_coeffs: list[int],
    out_coeffs: list[int],
    sym: list[int],
    stepped: list[int],
    feed: list[int],
) -> tuple[list[Tensor], int, int]:
    """``program_loop``'s call: every step's outputs, with the number of steps and the size
    symbol it resolved (what ``loop_plan.LoopPlan`` records)."""
    name = "program_loop"
    if any(d not in (0, 1) for d in out_dtypes):
        raise fail(name, f"out_dtypes {list(out_dtypes)}: each 0 (float32) or 1 (int8)")
    steps = _roles(inputs, list(stepped), list(feed), len(out_dtypes))
    step_inputs = [x[0] if s else x for x, s in zip(inputs, stepped, strict=True)]
    program_checks.symbol(step_inputs, sym)
    size = _size(step_inputs, list(sym))
    expected = _shapes(_resolve(list(in_shapes), list(in_coeffs), size), list(in_ranks))
    if [list(x.shape) for x in step_inputs] != expected:
        raise fail(
            name,
            f"compiled for steps of shapes {expected}, got {[list(x.shape) for x in step_inputs]}"
            ": lower the model again with example inputs of these shapes",
        )
    out_step = _shapes(_resolve(list(out_shapes), list(out_coeffs), size), list(out_ranks))
    for o, f in enumerate(map(_fed, feed)):
        if f >= 0 and (out_step[o] != expected[f] or DTYPES[out_dtypes[o]] != inputs[f].dtype):
            raise fail(name, f"output {o} feeds input {f}, of another shape or dtype")
    dense = [x if s and row_stride(x[0]) is not None else x.contiguous()
             for x, s in zip(inputs, stepped, strict=True)]  # fmt: skip
    outs = [
        torch.empty([_steps_kept(f, steps), *shape], dtype=DTYPES[d])
        for shape, d, f in zip(out_step, out_dtypes, feed, strict=True)
    ]
    program_checks.program(
        [x[0] if s else x for x, s in zip(dense, stepped, strict=True)], consts, code, fcode,
        slots, in_slots, out_slots, out_dtypes, size, [o[0] for o in outs],
    )  # fmt: skip
    step_bytes = [x.stride(0) * x.element_size() if s else 0 for x, s in zip(dense, stepped,
                  strict=True)]  # fmt: skip
    row_bytes = [(row_stride(x[0]) or 0) * x.element_size() if s else 0
                 for x, s in zip(dense, stepped, strict=True)]  # fmt: skip
    a = NativeArgs(name)  # every address below points into a tensor ``a`` holds
    a.held.extend(dense)  # a stepped input may be a strided view: its rows read in place
    addresses = (ctypes.c_void_p * max(len(dense), 1))(*(x.data_ptr() for x in dense))
    kernels().qt_program_loop(
        addresses, a.input("in_slots", in_slots),
        a.input("in_step", torch.tensor(step_bytes, dtype=torch.int64)),
        a.input("in_ld", torch.tensor(row_bytes, dtype=torch.int64)), len(dense),
        a.outputs("outputs", outs), a.input("out_slots", out_slots),
        a.input("feed", torch.tensor(list(feed), dtype=torch.int64)), len(outs), steps,
        a.input("slots", slots), slots.shape[0], slots.shape[1], size, a.input("code", code),
        a.input("fcode", fcode), code.shape[0], a.inputs("consts", consts),
    )  # fmt: skip
    return outs, steps, int(size)


@torch.library.register_fake("quantree::program_loop")
def _(inputs, consts, code, fcode, slots, in_slots, out_slots, in_shapes, in_ranks, out_shapes,
      out_ranks, out_dtypes, in_coeffs, out_coeffs, sym, stepped, feed):  # fmt: skip
    step_inputs = [x[0] if s else x for x, s in zip(inputs, stepped, strict=True)]
    steps = next(x.shape[0] for x, s in zip(inputs, stepped, strict=True) if s)
    size = _size(step_inputs, list(sym))
    out_step = _shapes(_resolve(list(out_shapes), list(out_coeffs), size), list(out_ranks))
    return [
        torch.empty([_steps_kept(f, steps), *shape], dtype=DTYPES[d])
        for shape, d, f in zip(out_step, out_dtypes, feed, strict=True)
    ]
