"""A cells-mode layer whose every loop runs natively, called with little Python around it.

``RecurrentCells`` is backend-neutral: per layer and direction it selects each initial
state, calls the loop module, and stacks the final states at the end, about a dozen tensor
ops and two module calls. For a decoder stepped once per output token that Python cost as
much as the native work of the step. Once the CPU backend has made every loop of a layer a
``NativeCellLoop``, this subclass runs the same computation with the final states made
first (one copy of each initial state, or zeros) and each loop's program reading and
updating its rows in place through pointers, so a call is the input transpose, one output
tensor per loop and the native calls. A packed sequence takes the same path, each loop one
``qt_cell_loop_packed`` call on the rows: through the generic forward each loop was a
dispatcher call of ``quantree.cell_loop_packed`` that checked and copied ``batch_sizes``,
read the program's widths back element by element and rebuilt its argument block: more
Python than native work for a small packed GRU (outside models' ``gru_packed``). Here
``batch_sizes`` is checked once per call for every loop. Anything the fast path does
not cover (the fake tensors of ``torch.export`` when the model is saved, inputs of the
wrong shape, which the loop then names) runs ``RecurrentCells.forward`` as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor, nn

from quantree.backends.cpu.cells.program import NativeCellLoop
from quantree.backends.cpu.native import checks as native_checks
from quantree.recurrent.loop import RecurrentCells, loop_name


class NativeRecurrentCells(RecurrentCells):
    """``RecurrentCells`` over native loops only: the same outputs, bit for bit."""

    def __init__(self, cells: RecurrentCells) -> None:
        nn.Module.__init__(self)
        self.state_sizes = cells.state_sizes
        self.kind = cells.kind
        self.num_layers = cells.num_layers
        self.directions = cells.directions
        self.batch_first = cells.batch_first
        self.loops = cells.loops
        self.order = tuple(
            loop_name(layer, d) for layer in range(self.num_layers) for d in range(self.directions)
        )

    @staticmethod
    def covers(cells: RecurrentCells) -> bool:
        """Whether every loop of ``cells`` is a native program."""
        return all(isinstance(loop, NativeCellLoop) for loop in cells.loops.values())

    def forward(self, x: Tensor, hx: Any, batch_sizes: Tensor | None = None):
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        packed = batch_sizes is not None
        plain = type(x) is Tensor and all(s is None or type(s) is Tensor for s in states)
        plain = plain and (not packed or type(batch_sizes) is Tensor)
        if not plain or x.dim() != (2 if packed else 3):
            return super().forward(x, hx, batch_sizes)
        sizes: Tensor | None = None
        if batch_sizes is not None:
            # checked once for every loop (they read the same steps): ints, non-increasing,
            # at least 1, summing to the rows
            steps = native_checks.packed_batch_sizes("cell_loop_packed", batch_sizes, x.shape[0])
            batch = steps[0]
            sizes = batch_sizes
            if sizes.dtype is not torch.int64 or not sizes.is_contiguous():
                sizes = torch.tensor(steps, dtype=torch.int64)
            xs = x
        else:
            xs = x.transpose(0, 1) if self.batch_first else x
            batch = xs.shape[1]
        count = len(self.order)
        finals: list[Tensor] = []
        for s, size in zip(states, self.state_sizes, strict=True):
            if s is None:
                finals.append(torch.zeros(count, batch, size))
            elif s.shape != (count, batch, size):
                return super().forward(x, hx, batch_sizes)  # raises, naming the shapes
            elif s.dtype is torch.float32 and s.is_contiguous():
                finals.append(s.clone())
            else:  # as each loop's ``.float().contiguous().clone()`` of its slice
                finals.append(s.to(torch.float32, memory_format=torch.contiguous_format, copy=True))
        loops = self.loops
        index = 0
        for _ in range(self.num_layers):
            if xs.dtype is not torch.float32 or not xs.is_contiguous():
                xs = xs.float().contiguous()
            outs = []
            for _ in range(self.directions):
                loop: Any = loops[self.order[index]]
                widths = loop.ready()
                if widths[0] != xs.shape[-1] or widths[1:] != self.state_sizes:
                    return super().forward(x, hx, batch_sizes)  # the loop names the shapes
                rows = [f.data_ptr() + index * f.stride(0) * 4 for f in finals]
                pointers = (ctypes.c_void_p * len(rows))(*rows)
                if sizes is None:
                    ys = torch.empty(xs.shape[0], batch, widths[1])
                    loop.runner.launch(xs, ys, loop.reverse, pointers)
                else:
                    ys = torch.empty(xs.shape[0], widths[1])
                    loop.runner.launch_packed(xs, ys, sizes, batch, loop.reverse, pointers)
                outs.append(ys)
                index += 1
            xs = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        if packed or not self.batch_first:
            return (xs, *finals)
        return (xs.transpose(0, 1), *finals)
