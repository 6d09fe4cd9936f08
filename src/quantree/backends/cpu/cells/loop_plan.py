"""A folded loop's native call planned once per input layout (``NativeProgramLoop``).

``quantree.program_loop`` (``program_loop.py``) re-derives on every call what one loop's
calls share: the roles and the tables' verdict, the step shapes resolved from the integer
lists, which per-step inputs are read in place and their byte strides (three small tensors
made per call), one ``NativeArgs`` check per table and constant: more than the kernel of a
loop of a few steps (xLSTM's 4 chunks at 64 tokens: benchmarks/README.md, branch
``h-xlstm64``).

``LoopPlan`` is made from a call the op ran in full (every check passed, the kernel ran):
it keeps the outputs' shapes and dtypes, the in-place / dense choice and byte strides of
each input, and the addresses of the tables and constants. A later call takes it only if
each input has the planned dtype, shape and strides (so the same rows are read at the same
offsets from its own data pointer) and each table and constant is the checked tensor
unchanged (identity, version, data pointer, as ``native/bound_calls.py``); else the op runs
in full again. The plan holds the checked tensors, so the addresses stay valid.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from quantree.backends.cpu.cells.program_loop import kernels, row_stride
from quantree.backends.cpu.native.args import NativeArgs

Layout = tuple[tuple[torch.dtype, torch.Size, tuple[int, ...]], ...]


def layout(inputs: Sequence[Tensor]) -> Layout | None:
    """The plan key: each input's dtype, shape and strides (None: a tensor the plan does not
    read as is, such as export's fake tensors)."""
    if not all(type(x) is Tensor for x in inputs):
        return None
    return tuple((x.dtype, x.shape, x.stride()) for x in inputs)


class LoopPlan:
    """One checked ``program_loop`` call, reusable for inputs of the same ``layout``."""

    __slots__ = ("dense", "fixed", "held", "n_in", "n_out", "outs", "picks", "rest", "tail")

    def __init__(
        self, inputs: Sequence[Tensor], stepped: Sequence[int], fixed: Sequence[Tensor],
        consts: Sequence[Tensor], tables: Sequence[Tensor], outs: Sequence[Tensor],
        feed: Sequence[int], steps: int, size: int,
    ) -> None:  # fmt: skip
        code, fcode, slots, in_slots, out_slots = tables
        self.dense = tuple(bool(s) and row_stride(x[0]) is not None for x, s in
                           zip(inputs, stepped, strict=True))  # fmt: skip
        """Per input: read in place (a stepped view whose rows are evenly spaced)."""
        dense = [x if keep else x.contiguous() for x, keep in zip(inputs, self.dense, strict=True)]
        step_bytes = [x.stride(0) * x.element_size() if s else 0
                      for x, s in zip(dense, stepped, strict=True)]  # fmt: skip
        row_bytes = [(row_stride(x[0]) or 0) * x.element_size() if s else 0
                     for x, s in zip(dense, stepped, strict=True)]  # fmt: skip
        held = NativeArgs("program_loop")
        self.outs = tuple((o.shape, o.dtype) for o in outs)
        self.n_in, self.n_out = len(inputs), len(outs)
        self.fixed = tuple((t, t._version, t.data_ptr()) for t in fixed)
        self.tail = (
            held.input("in_slots", in_slots),
            held.input("in_step", torch.tensor(step_bytes, dtype=torch.int64)),
            held.input("in_ld", torch.tensor(row_bytes, dtype=torch.int64)), len(inputs),
        )  # fmt: skip
        self.rest = (
            held.input("out_slots", out_slots),
            held.input("feed", torch.tensor(list(feed), dtype=torch.int64)), len(outs), steps,
            held.input("slots", slots), slots.shape[0], slots.shape[1], size,
            held.input("code", code), held.input("fcode", fcode), code.shape[0],
            held.inputs("consts", consts),
        )  # fmt: skip
        """The kernel's arguments after the outputs' addresses."""
        self.held = (held, tuple(fixed))
        """What those addresses point into (and the checked tensors), alive with the plan."""
        self.picks: tuple[tuple[int, int | None, Any], ...] = ()

    def pick(self, places: Sequence[tuple[int, int | None, Any]]) -> None:
        """Read the inputs straight from the loop's arguments: per input, the argument
        index, the byte offset of its first step in it (None: the argument, made dense) and
        a cut (None, or a function making the per-step input dense from the argument). The
        plan key is then the arguments' layout."""
        self.picks = tuple(places)

    def run_args(self, args: Sequence[Tensor]) -> list[Tensor]:
        """Every step's outputs, the inputs taken from the loop's arguments (``pick``)."""
        held = []
        addresses = (ctypes.c_void_p * max(self.n_in, 1))()
        for j, (i, offset, cut) in enumerate(self.picks):
            x = args[i]
            if cut is not None:
                x = cut(x)
            elif offset is None and not x.is_contiguous():
                x = x.contiguous()
            held.append(x)
            addresses[j] = x.data_ptr() + (offset or 0)
        return self._call(addresses, held)

    def matches(self, fixed: Sequence[Tensor]) -> bool:
        """The tables and constants are the checked tensors, unchanged."""
        if len(fixed) != len(self.fixed):
            return False
        for t, (c, version, pointer) in zip(fixed, self.fixed, strict=True):
            if t is not c or t._version != version or t.data_ptr() != pointer:
                return False
        return True

    def _call(self, addresses: ctypes.Array, held: list[Tensor]) -> list[Tensor]:
        """The kernel on input ``addresses`` (into ``held``, alive through the call)."""
        outs = [torch.empty(shape, dtype=dtype) for shape, dtype in self.outs]
        out_addresses = (ctypes.c_void_p * max(self.n_out, 1))(*(o.data_ptr() for o in outs))
        in_slots, in_step, in_ld, n_in = self.tail
        kernels().qt_program_loop(addresses, in_slots, in_step, in_ld, n_in, out_addresses,
                                  *self.rest)  # fmt: skip
        return outs
