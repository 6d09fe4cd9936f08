"""``StepLoop``: a recurrence folded back into a loop over one step graph.

The cells-mode ``CellLoop`` generalised: any number of carried states, per-step inputs cut
from any dimension of any tensor (``select`` or ``narrow`` at the step's index), loop
invariants, and per-step outputs collected by ``stack``/``cat`` or kept from the last step.
The body is an ordinary ``GraphModule``, so prepare, convert and the backends treat it like
the main graph (annotated once, one observer per point for every step). The number of steps
is read from the per-step inputs' time dimension when the captured steps covered all of it,
so the loop runs at any length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor, nn

from quantree.core.errors import QuantreeError
from quantree.core.observing.observers import Observer, per_call


@dataclass(frozen=True)
class StepInput:
    """Step ``k`` reads ``src.select(dim, start + k stride)`` (``width`` 0) or
    ``src.narrow(dim, start + k stride, width)``; when ``stride`` is negative, ``start``
    counts from the end of ``dim`` (the first index is ``size - max(width, 1) - start``)."""

    dim: int
    start: int
    stride: int
    width: int


@dataclass(frozen=True)
class StepOutput:
    """Body output ``index`` after the states: ``stack``/``cat`` (``kind``) of every step's
    value along ``dim`` (in reverse step order if ``reverse``), or ``last``: the last step's."""

    kind: str
    dim: int
    reverse: bool


class StepLoop(nn.Module):
    """``forward(*initial_states, *sources, *invariants) -> (*final_states, *outputs)``."""

    def __init__(
        self,
        body: fx.GraphModule,
        n_states: int,
        inputs: tuple[StepInput, ...],
        outputs: tuple[StepOutput, ...],
        steps_captured: int,
        free: bool,
    ) -> None:
        super().__init__()
        self.body = body
        self.n_states = n_states
        self.inputs = inputs
        self.outputs = outputs
        self.steps_captured = steps_captured
        self.free = free
        """True: as many steps as the first input's time dimension holds (the captured steps
        read all of it); False: always ``steps_captured``."""

    def length(self, sources: tuple[Tensor, ...]) -> int:
        if not self.free:
            return self.steps_captured
        spec, src = self.inputs[0], sources[0]
        return (src.shape[spec.dim] - max(spec.width, 1)) // abs(spec.stride) + 1

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        if any(isinstance(m, Observer) for m in self.body.modules()):
            with per_call(self.body):  # calibrating: the steps of one call are one observation
                return self.run(args)
        return self.run(args)

    def run(self, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        n, m = self.n_states, len(self.inputs)
        states, sources, invariants = args[:n], args[n : n + m], args[n + m :]
        steps = self.length(sources)
        if steps < 1:
            raise QuantreeError(
                f"a folded loop ({self.body.__class__.__name__}) got inputs of shapes "
                f"{[tuple(s.shape) for s in sources]}: no time step; give at least one"
            )
        starts = []
        for spec, src in zip(self.inputs, sources, strict=True):
            size = src.shape[spec.dim]
            starts.append(spec.start if spec.stride > 0 else size - max(spec.width, 1) - spec.start)
        per_step: list[list[Tensor]] = [[] for _ in self.outputs]
        for k in range(steps):
            xs = [
                src.select(s.dim, t0 + k * s.stride)
                if s.width == 0
                else src.narrow(s.dim, t0 + k * s.stride, s.width)
                for s, src, t0 in zip(self.inputs, sources, starts, strict=True)
            ]
            out = self.body(*states, *xs, *invariants)
            states = tuple(out[:n])
            for i, value in enumerate(out[n:]):
                if self.outputs[i].kind == "last":
                    per_step[i] = [value]
                else:
                    per_step[i].append(value)
        results = list(states)
        for out, values in zip(self.outputs, per_step, strict=True):
            if out.kind == "last":
                results.append(values[0])
                continue
            ordered = values[::-1] if out.reverse else values
            join = torch.stack if out.kind == "stack" else torch.cat
            results.append(join(ordered, out.dim))
        return tuple(results)
