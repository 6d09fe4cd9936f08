"""A cells-mode layer whose every loop runs natively, called with little Python around it.

``RecurrentCells`` is backend-neutral: per layer and direction it selects each initial
state, calls the loop module, and stacks the final states at the end, about a dozen tensor
ops and two module calls. For a decoder stepped once per output token that was ~20 us per
step around ~20 us of native work. Once the CPU backend has made every loop of a layer a
``NativeCellLoop``, this subclass runs the same computation with the final states made
first (one copy of each initial state, or zeros) and each loop's program reading and
updating its rows in place through pointers, so a call is the input transpose, one output
tensor per loop and the native calls. Anything the fast path does not cover (a packed
sequence, the fake tensors of ``torch.export`` when the model is saved, inputs of the wrong
shape, which the loop then names) runs ``RecurrentCells.forward`` as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor, nn

from quantree.backends.cpu.cells_native import NativeCellLoop
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
        plain = type(x) is Tensor and all(s is None or type(s) is Tensor for s in states)
        if batch_sizes is not None or not plain or x.dim() != 3:
            return super().forward(x, hx, batch_sizes)
        xs = x.transpose(0, 1) if self.batch_first else x
        batch, count = xs.shape[1], len(self.order)
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
                if widths[0] != xs.shape[2] or widths[1:] != self.state_sizes:
                    return super().forward(x, hx, batch_sizes)  # the loop names the shapes
                rows = [f.data_ptr() + index * f.stride(0) * 4 for f in finals]
                ys = torch.empty(xs.shape[0], batch, widths[1])
                loop.runner.launch(xs, ys, loop.reverse, (ctypes.c_void_p * len(rows))(*rows))
                outs.append(ys)
                index += 1
            xs = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        return (xs.transpose(0, 1) if self.batch_first else xs, *finals)
