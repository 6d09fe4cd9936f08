"""A folded loop (``recurrent.unrolled.StepLoop``) whose lowered step is a cell program.

A folded ``GRUCell``/``LSTMCell`` loop (its cell written out as cells mode's cell graph)
lowers to the ops the native cell program runs. Where the loop reads one per-step input
(``select`` at the step, in order) and collects one per-step output that is its first state
(``stack`` along the input's time dimension), it is a cells-mode loop with the time
dimension elsewhere: the step is compiled with ``compile_body`` (input first, then the
states) and run for all steps in one native call by ``NativeCellLoop``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor, nn

from quantree.backends.cpu.cells.program import NativeCellLoop, compile_body
from quantree.recurrent.unrolled.step_loop import StepLoop


class NativeStepLoop(nn.Module):
    """``StepLoop``'s call (``*states, source``) -> ``(*final_states, stacked)``, natively."""

    def __init__(self, cell: NativeCellLoop, n_states: int, batch_first: bool) -> None:
        super().__init__()
        self.cell = cell
        self.n_states = n_states
        self.batch_first = batch_first

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        # transpose, not movedim: a saved model holds only the ops quantree's loader reads
        states, source = args[: self.n_states], args[self.n_states]
        xs = source.transpose(0, 1) if self.batch_first else source
        ys, finals = self.cell(xs, tuple(states))
        return (*finals, ys.transpose(0, 1) if self.batch_first else ys)


def native_step_loop(loop: StepLoop) -> NativeStepLoop | None:
    """The native loop computing ``loop`` (lowered), or None where it is not a cell loop."""
    if len(loop.inputs) != 1 or len(loop.outputs) != 1 or not loop.free:
        return None
    spec, out = loop.inputs[0], loop.outputs[0]
    if (spec.width, spec.stride, spec.start) != (0, 1, 0) or out.kind != "stack" or out.reverse:
        return None
    graph = loop.body.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    results = list(output.args[0])  # type: ignore[arg-type]
    n = loop.n_states
    if len(placeholders) != n + 1 or len(results) != n + 1 or results[n] is not results[0]:
        return None
    reordered = _input_first(loop.body, placeholders[n], results[:n])
    example = []
    for p in (placeholders[n], *placeholders[:n]):
        val = p.meta.get("val")
        if not isinstance(val, Tensor) or val.dim() != 2:
            return None
        example.append(torch.zeros([s if isinstance(s, int) else 2 for s in val.shape]))
    program = compile_body(reordered, tuple(example))
    if program is None:
        return None
    dim, stack_dim = spec.dim % 3, out.dim % 3  # the source is [T, B, I] or [B, T, I]
    if dim != stack_dim or dim == 2:
        return None
    return NativeStepLoop(NativeCellLoop(program, False), n, batch_first=dim == 1)


def _input_first(body: fx.GraphModule, x: fx.Node, states: list[fx.Node]) -> fx.GraphModule:
    """A copy of ``body`` taking ``(x, *states)`` and returning the new states only."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    order = [x] + [n for n in body.graph.nodes if n.op == "placeholder" and n is not x]
    for p in order:
        env[p] = graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in body.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[s] for s in states))
    return fx.GraphModule(body, graph, class_name="StepCell")
