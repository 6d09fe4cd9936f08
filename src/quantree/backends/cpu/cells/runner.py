"""A native cell loop's call path with its argument block built once.

An unrolled decoder (a seq2seq model stepping its ``nn.LSTM`` once per output token) runs
one cells-mode loop per step, each a single time step of native work. Through the op, each
call paid several times that in Python around it: the dispatcher boxing eight arguments, a
constant list read through ``Module.__getattr__``, the program's widths read back from a
tensor element by element, and a ctypes array of every constant's pointer made again. The
runner keeps what does not change between calls (the pointers of the program and its
constants, the widths it checks the inputs against) and rebuilds it only when one of those
tensors is replaced by another (``load_state_dict`` copies in place and keeps them; a
deep copy starts with no runner state). Each call then converts the input, output and state
pointers only. The native call and its arguments are the op's, so the bits are the same.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from quantree.backends.cpu.native import program_checks
from quantree.backends.cpu.native.checks import fail
from quantree.backends.cpu.native.loader import I64, INT, PTR, ptr
from quantree.backends.cpu.native.loader import kernels as native_kernels

SIGNATURES: dict[str, list[type]] = {
    "qt_cell_loop": [PTR, PTR, I64, INT, PTR, I64, PTR, PTR, I64, I64, PTR, PTR,
                     I64, PTR],
    "qt_cell_loop_packed": [PTR, PTR, I64, INT, PTR, PTR, I64, PTR, PTR, I64, I64,
                            PTR, PTR, I64, PTR],
}  # fmt: skip
"""The C entry points the cell loops call (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


class CellLoopRunner:
    """``quantree.cell_loop`` for plain CPU tensors, on an argument block made once."""

    def __init__(self) -> None:
        self.key: tuple[Tensor, ...] = ()
        self.widths: tuple[int, ...] = ()
        self.args: tuple = ()
        self.run: Callable[..., None] = kernels().qt_cell_loop
        self.run_packed: Callable[..., None] = kernels().qt_cell_loop_packed
        self.keep: tuple = ()
        self.workspace = (0, 0, 0)
        """The verdict's workspace bytes ``ws0 + ws1 batch``, and the constants' bytes."""

    def __getstate__(self) -> dict:  # a copy builds its own block from its own tensors
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def __call__(
        self,
        xs: Tensor,
        state: Sequence[Tensor],
        consts: Sequence[Tensor],
        program: tuple[Tensor, Tensor, Tensor, Tensor],
        reverse: bool,
    ) -> list[Tensor]:
        """``[ys, *final_states]`` of the program ``(code, fcode, slots, outs)`` over
        ``xs`` [T, B, I] from ``state`` (each [B, width]), as ``cell_loop`` computes them."""
        widths = self.ready(consts, program)
        if xs.dtype is not torch.float32 or not xs.is_contiguous():
            xs = xs.float().contiguous()
        finals = [
            s.clone() if s.dtype is torch.float32 and s.is_contiguous() else
            s.float().contiguous().clone()
            for s in state
        ]  # fmt: skip
        batch = xs.shape[1] if xs.dim() == 3 else -1
        if (
            batch < 0
            or len(finals) != len(widths) - 1
            or xs.shape[2] != widths[0]
            or any(f.shape != (batch, w) for f, w in zip(finals, widths[1:], strict=True))
        ):
            raise fail(
                "cell_loop",
                f"compiled for [batch, {widths[0]}] inputs and states of widths "
                f"{list(widths[1:])}, got input {tuple(xs.shape)} and states "
                f"{[tuple(f.shape) for f in finals]}",
            )
        io_bytes = 4 * (xs.numel() + sum(f.numel() for f in finals))
        program_checks.cell_loop(len(finals), consts, *program, batch, io_bytes)  # cached
        ys = torch.empty(xs.shape[0], batch, widths[1])
        states = (ctypes.c_void_p * len(finals))(*[f.data_ptr() for f in finals])
        self.launch(xs, ys, reverse, states)
        return [ys, *finals]

    def ready(
        self, consts: Sequence[Tensor], program: tuple[Tensor, Tensor, Tensor, Tensor]
    ) -> tuple[int, ...]:
        """Prepare for these tensors unless prepared for them already; the program's input
        and state widths."""
        key = (*program, *consts)
        if len(key) != len(self.key) or not all(map(operator.is_, key, self.key)):
            self.prepare(key, program, consts)
        return self.widths

    def launch(self, xs: Tensor, ys: Tensor, reverse: bool, states: ctypes.Array) -> None:
        """The native loop over float ``xs`` [T, B, I] (dense) into ``ys`` [T, B, H], the
        states read from and written back to the float rows ``states`` points at; after
        ``ready``, with shapes checked by the caller."""
        outs, slots, n_slots, code, fcode, n_code, const_ptrs = self.args
        self.bound(xs.shape[1], xs, ys)
        self.run(
            xs.data_ptr(), ys.data_ptr(), xs.shape[0], int(reverse), states, len(states), outs,
            slots, n_slots, xs.shape[1], code, fcode, n_code, const_ptrs,
        )  # fmt: skip

    def launch_packed(
        self,
        xs: Tensor,
        ys: Tensor,
        sizes: Tensor,
        batch: int,
        reverse: bool,
        states: ctypes.Array,
    ) -> None:
        """``launch`` on a packed sequence's float rows ``xs`` [N, I] into ``ys`` [N, H]:
        step t on the first ``sizes[t]`` rows of the states (``sizes`` int64, dense, checked
        by the caller as ``native.checks.packed_batch_sizes`` does; ``batch`` its first entry,
        the states' rows)."""
        outs, slots, n_slots, code, fcode, n_code, const_ptrs = self.args
        self.bound(batch, xs, ys)
        self.run_packed(
            xs.data_ptr(), ys.data_ptr(), sizes.shape[0], int(reverse), sizes.data_ptr(), states,
            len(states), outs, slots, n_slots, batch, code, fcode, n_code, const_ptrs,
        )  # fmt: skip

    def bound(self, batch: int, xs: Tensor, ys: Tensor) -> None:
        """The workspace the kernel lays out for ``batch`` rows, bounded as
        ``program_checks.call`` bounds it (the tables were checked at ``prepare``)."""
        ws0, ws1, held = self.workspace
        ws = ws0 + ws1 * batch
        if ws > program_checks.WORKSPACE_FLOOR:
            io_bytes = xs.numel() * xs.element_size() + ys.numel() * ys.element_size()
            program_checks.workspace_bound("cell_loop", ws, batch, held + io_bytes)

    def prepare(
        self,
        key: tuple[Tensor, ...],
        program: tuple[Tensor, Tensor, Tensor, Tensor],
        consts: Sequence[Tensor],
    ) -> None:
        code, fcode, slots, outs = program
        n_states = int(outs.shape[0])
        # the program's contract once per set of tensors (``launch`` callers check only the
        # inputs' shapes)
        verdict = program_checks.cell_loop(n_states, consts, *program, 0)
        held = sum(c.numel() * c.element_size() for c in consts)
        self.workspace = (verdict.ws0, verdict.ws1, held)
        dense = [c.contiguous() for c in consts]
        const_ptrs = (ctypes.c_void_p * max(len(dense), 1))(*[ptr(c) for c in dense])
        self.widths = tuple(int(w) for w in slots[: 1 + n_states, 3].tolist())
        self.args = (
            ptr(outs), ptr(slots), slots.shape[0], ptr(code), ptr(fcode), code.shape[0],
            const_ptrs,
        )  # fmt: skip
        self.key, self.keep = key, (dense, const_ptrs)
        self.run = kernels().qt_cell_loop
        self.run_packed = kernels().qt_cell_loop_packed
