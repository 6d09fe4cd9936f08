"""Region programs bound to one graph node: the tables' contract checked once per input shape.

A region program's call (``ops/program.py``) re-derives on every call what cannot change
between calls of one node: the tables' verdict lookup (stamps of five tables), the shapes
resolved from the integer lists, the workspace bound, one ``NativeArgs`` check per input,
constant and output. For a small program (a recurrent block's few hundred values) that is
more than its kernel (xLSTM at 64 tokens: benchmarks/README.md, branch ``h-xlstm64``).

``BoundProgram`` runs the op in full on a node's first call for a set of input shapes (every
check, the kernel, the outputs), then keeps a plan: the output shapes and dtypes, the
addresses of the tables and constants, and what the verdict rests on. A later call takes the
plan only if each input is a plain tensor of the planned dtype and shape, each table and
constant is the checked tensor unchanged (identity, version, data pointer: the ways a tensor
changes, ``bound_calls.py``), and the integer lists equal the planned ones; anything else
runs the op in full again (and plans anew). The plan holds the checked tensors (and the dense
copies the addresses point into), so their memory stays alive while it is kept.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.ops.program import kernels, program, symbol_size

PLAIN = torch.Tensor
READABLE = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose memory the kernel reads as is (a model's weights are parameters);
any other subclass (export's fake tensors) goes through the op."""
TABLES = slice(2, 7)
"""``program``'s arguments ``code, fcode, slots, in_slots, out_slots``."""
PLANS_KEPT = 8
"""Input shapes a node keeps a plan for (a model sees few; others run the op in full)."""


class ProgramPlan:
    """One checked call of a region program: what a call with the same shapes reuses."""

    __slots__ = ("dtypes", "fixed", "keep", "kernel", "n_in", "n_out", "outs", "rest", "tail")

    def __init__(self, args: tuple[Any, ...], outs: list[Tensor]) -> None:
        inputs, consts = args[0], args[1]
        code, fcode, slots, in_slots, out_slots = args[TABLES]
        held = NativeArgs("program")
        self.dtypes = tuple((x.dtype, x.shape) for x in inputs)
        self.outs = tuple((o.shape, o.dtype) for o in outs)
        self.rest = tuple(list(a) if isinstance(a, list | tuple) else a for a in args[7:])
        fixed = (*args[TABLES], *consts)
        self.fixed = tuple((t, t._version, t.data_ptr()) for t in fixed)
        self.n_in, self.n_out = len(inputs), len(outs)
        size = _size_of(args)
        self.tail = (
            held.input("out_slots", out_slots), len(outs), held.input("slots", slots),
            slots.shape[0], slots.shape[1], size, held.input("code", code),
            held.input("fcode", fcode), code.shape[0], held.inputs("consts", consts),
        )  # fmt: skip
        self.kernel = (held.input("in_slots", in_slots), len(inputs))
        self.keep = (fixed, held)

    def matches(self, args: tuple[Any, ...]) -> bool:
        inputs = args[0]
        if len(inputs) != self.n_in:
            return False
        for x, (dtype, shape) in zip(inputs, self.dtypes, strict=True):
            if type(x) not in READABLE or x.dtype is not dtype or x.shape != shape:
                return False
        fixed = (*args[TABLES], *args[1])
        if len(fixed) != len(self.fixed):
            return False
        for t, (c, version, pointer) in zip(fixed, self.fixed, strict=True):
            if t is not c or t._version != version or t.data_ptr() != pointer:
                return False
        rest = args[7:]
        if len(rest) != len(self.rest):
            return False
        return all(list(a) == b if isinstance(b, list) else a == b
                   for a, b in zip(rest, self.rest, strict=True))  # fmt: skip

    def run(self, inputs: Sequence[Tensor], kernel: Callable[..., Any]) -> list[Tensor]:
        dense = [x if x.is_contiguous() else x.contiguous() for x in inputs]
        outs = [torch.empty(shape, dtype=dtype) for shape, dtype in self.outs]
        in_array = (ctypes.c_void_p * max(self.n_in, 1))(*(x.data_ptr() for x in dense))
        out_array = (ctypes.c_void_p * max(self.n_out, 1))(*(o.data_ptr() for o in outs))
        in_slots, n_in = self.kernel
        kernel(in_array, in_slots, n_in, out_array, *self.tail)
        return outs


def _size_of(args: tuple[Any, ...]) -> int:
    """The size symbol the op resolved for these inputs."""
    sym = list(args[14]) if len(args) > 14 and args[14] is not None else []
    return int(symbol_size(args[0], sym))


class BoundProgram:
    """``quantree.program`` for one graph node (``direct.BoundCall``'s ``binding``): the op
    in full on a new input shape, then its plan (``ProgramPlan``) while the call matches."""

    def __init__(self, fallback: Callable[..., Any]) -> None:
        self.fallback = fallback
        """The op itself: fake tensors (export) and every call no plan covers."""
        self.plans: dict[tuple, ProgramPlan] = {}

    def __getstate__(self) -> dict:  # a copied graph plans with its own constants
        return {"fallback": self.fallback}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fallback"])  # type: ignore[misc]

    @property
    def bound(self) -> bool:
        return bool(self.plans)

    def fast(self, args: tuple[Any, ...]) -> Any:
        inputs = args[0]
        if len(args) >= 12 and isinstance(inputs, list | tuple):
            key = tuple(x.shape if type(x) in READABLE else None for x in inputs)
            plan = self.plans.get(key)
            if plan is not None and plan.matches(args):
                return plan.run(inputs, kernels().qt_program_run)
        else:
            key = None
        if key is None or None in key or not self._plannable(args):
            return self.fallback(*args)  # export's fake tensors: the op
        outs = program(*args)  # every check, then the kernel
        if len(self.plans) >= PLANS_KEPT:
            self.plans.clear()
        self.plans[key] = ProgramPlan(args, outs)
        return outs

    @staticmethod
    def _plannable(args: tuple[Any, ...]) -> bool:
        """Tensors the kernel reads as they are, throughout."""
        tensors = [*args[0], *args[1], *args[TABLES]]
        return all(type(t) in READABLE for t in tensors)
