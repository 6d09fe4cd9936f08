"""Cells mode: a recurrent node becomes a loop over a cell graph.

The loop is a module of our own rather than unrolled time steps or PyTorch's ``scan``:
``CellLoop`` runs its body ``GraphModule`` once per step, so the graph does not grow with the
sequence length, the length may change between calls, and observers inside the body
accumulate statistics over every step. ``scan`` was the alternative; its eager path runs the
same Python loop, and a plain module keeps the body an ordinary GraphModule that prepare,
convert and backends treat exactly like the main graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from quantree.core.observing.observers import Observer, per_call
from quantree.recurrent.call import RecurrentCall


class CellLoop(nn.Module):
    """Runs ``body(x_t, *state) -> new state`` over time; the first state leaf is the output.

    On a packed sequence (``batch_sizes`` given, ``xs`` the packed rows) step ``t`` runs the
    body on the first ``batch_sizes[t]`` sequences only: packing sorts them longest first, so
    the ones still running are a prefix, and the states of the others stay as they were
    (their final state, or in reverse their initial state until they start). That is
    PyTorch's packed semantics, and observers see only real steps, never padding.
    """

    def __init__(self, body: fx.GraphModule, reverse: bool) -> None:
        super().__init__()
        self.body = body
        self.reverse = reverse

    def forward(
        self,
        xs: torch.Tensor,
        state: tuple[torch.Tensor, ...],
        batch_sizes: torch.Tensor | None = None,
    ):
        """``batch_sizes``: ``xs`` are a packed sequence's rows, ``batch_sizes`` its int64
        per-step batch sizes (a tensor, so a backend's loop can take it whole and stay
        traceable: its entries are data)."""
        if any(isinstance(m, Observer) for m in self.body.modules()):
            # calibrating: the steps of one batch are one observation
            with per_call(self.body):
                return self._run(xs, state, batch_sizes)
        return self._run(xs, state, batch_sizes)

    def _run(
        self, xs: torch.Tensor, state: tuple[torch.Tensor, ...], batch_sizes: torch.Tensor | None
    ):
        if batch_sizes is not None:
            return self._packed(xs, state, [int(n) for n in batch_sizes.tolist()])
        steps = range(xs.shape[0] - 1, -1, -1) if self.reverse else range(xs.shape[0])
        outputs: list[torch.Tensor] = [xs] * xs.shape[0]
        for t in steps:
            state = tuple(self.body(xs[t], *state))
            outputs[t] = state[0]
        return torch.stack(outputs), state

    def _packed(self, xs: torch.Tensor, state: tuple[torch.Tensor, ...], batch_sizes: list[int]):
        starts = [0]
        for size in batch_sizes:
            starts.append(starts[-1] + size)
        steps = range(len(batch_sizes))
        outputs: list[torch.Tensor] = [xs] * len(batch_sizes)
        for t in reversed(steps) if self.reverse else steps:
            n = batch_sizes[t]
            new = tuple(self.body(xs[starts[t] : starts[t + 1]], *(s[:n] for s in state)))
            state = tuple(torch.cat((a, s[n:])) for a, s in zip(new, state, strict=True))
            outputs[t] = new[0]
        return torch.cat(outputs), state


class RecurrentCells(nn.Module):
    """A whole ``aten.lstm/gru/rnn_*`` call as cell loops: same inputs, same outputs."""

    def __init__(
        self, call: RecurrentCall, loops: dict[str, CellLoop], state_sizes: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.state_sizes = state_sizes
        self.kind = call.kind
        self.num_layers = call.num_layers
        self.directions = 2 if call.bidirectional else 1
        self.batch_first = call.batch_first
        self.loops = nn.ModuleDict(loops)

    def forward(self, x: torch.Tensor, hx: Any, batch_sizes: torch.Tensor | None = None):
        """``hx`` leaves that are None are zero states sized for this call's batch.

        With ``batch_sizes`` (an ``aten.*.data`` call) ``x`` holds a packed sequence's rows and
        the output is packed the same way.
        """
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        packed = batch_sizes is not None
        if self.batch_first and not packed:
            x = x.transpose(0, 1)
        count = self.num_layers * self.directions
        batch = packed_batch(batch_sizes) if batch_sizes is not None else x.shape[1]
        states = [
            x.new_zeros(count, batch, size) if s is None else s
            for s, size in zip(states, self.state_sizes, strict=True)
        ]
        finals: list[list[torch.Tensor]] = [[] for _ in states]
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.directions):
                index = layer * self.directions + d
                loop = self.loops[loop_name(layer, d)]
                out, final = loop(x, tuple(s[index] for s in states), batch_sizes)
                outs.append(out)
                for k, s in enumerate(final):
                    finals[k].append(s)
            x = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        if self.batch_first and not packed:
            x = x.transpose(0, 1)
        return (x, *(torch.stack(f) for f in finals))


def packed_batch(batch_sizes: torch.Tensor) -> int:
    """The number of sequences of a packed sequence: its first step's batch size.

    Read with ``item()`` and checked positive, so ``torch.export`` (``quantree.backends.save``)
    traces it as an unbacked symbol instead of failing on a data-dependent ``int()``.
    """
    batch = batch_sizes[0].item()
    torch._check(batch >= 1)
    return batch  # type: ignore[return-value]


def loop_name(layer: int, direction: int) -> str:
    return f"l{layer}{'_reverse' if direction else ''}"
