"""What ``find`` says of an unrolled recurrence: its steps, what each step node reads, its
per-step inputs and what leaves the run (read by ``fold`` to build the loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


@dataclass(frozen=True)
class SeqInput:
    """A per-step input: ``src.select(dim, a + k b)`` (``width`` 0) or
    ``src.narrow(dim, a + k b, width)``."""

    src: fx.Node
    dim: int
    start: int
    stride: int
    width: int


@dataclass(frozen=True)
class StepWrite:
    """Step node ``value`` written into ``buffer``'s slice ``target`` (a step node cut at the
    step's own index, ``where`` as a per-step input would be): after the run, ``buffer``
    holds every step's value joined along ``where.dim``. Where each step writes the state it
    received (``initial`` is the state before the run), ``value`` is the state it passes on,
    and ``closing`` (nodes after the run) writes the last one into the buffer's last slot:
    the buffer is then ``initial`` followed by every step's ``value``."""

    buffer: fx.Node
    target: int
    value: int
    where: SeqInput
    views: tuple[int, ...] = ()  # whole-tensor slices between ``buffer`` and ``target``
    initial: fx.Node | None = None
    closing: tuple[fx.Node, ...] = ()  # the write after the run: its views, then the copy_


@dataclass
class Recurrence:
    """A run of ``steps`` copies of a step of ``length`` nodes starting at ``blocks[0][0]``."""

    blocks: list[list[fx.Node]]
    kinds: list[list[tuple[Any, ...]]]  # per step node j, per flattened argument leaf
    states: dict[int, fx.Node] = field(default_factory=dict)  # carried j -> initial node
    seq_of: dict[int, SeqInput] = field(default_factory=dict)  # step node j -> its input
    hoisted: set[int] = field(default_factory=set)  # invariant j computed once, before
    collected: dict[fx.Node, tuple[int, bool]] = field(default_factory=dict)  # -> j, reversed
    last: list[int] = field(default_factory=list)  # j read after the run (last step's)
    writes: dict[int, StepWrite] = field(default_factory=dict)  # copy_ j -> what it writes

    @property
    def steps(self) -> int:
        return len(self.blocks)
