"""Find a recurrence that ``torch.export`` unrolled: a run of isomorphic step subgraphs.

A Python loop over time (``for t in range(T): h = step(x[:, t], h)``) is traced once per
step, so the exported graph holds T copies of the step's nodes, one after the other. This
module finds the longest such run and says, for every argument of every step node, what it
reads, the same way in every step:

- a node of the same step (an edge of the step graph);
- the same node of the previous step (carried state), and in the first step a node before
  the run (the initial state);
- one node outside the run for every step (a loop invariant: a weight, a tensor computed
  before the loop);
- ``select(src, dim, a + k b)`` / ``slice(src, dim, s_k, s_k + w)`` of an invariant ``src``
  (the per-step input; the only place where an argument may change with the step ``k``);
- an equal constant.

A step may also write its result into its own slice of a fresh buffer (``out[:, t] = h``):
``writes`` proves when that write is a collected output and rejects the run otherwise.

Anything else (a step reading two steps back, an intermediate step value read outside the
run other than by the ``stack``/``cat`` collecting it) rejects the run, so a graph with no
repetition, or a repetition that is not a recurrence, is left alone. Nothing here knows a
recurrent layer: the step is whatever repeats.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from quantree.recurrent.unrolled.recurrence import Recurrence, SeqInput
from quantree.recurrent.unrolled.writes import mutates, step_writes

aten = torch.ops.aten
COLLECTORS = (aten.stack.default, aten.cat.default)
MAX_PERIODS = 8
"""Candidate step lengths tried per search: this many of the most frequent gaps between
equal ops, and as many of those covering the most nodes."""


def signature(n: fx.Node) -> tuple[Any, ...]:
    leaves, spec = tree_flatten((n.args, n.kwargs))
    shape = tuple("N" if isinstance(x, fx.Node) else type(x).__name__ for x in leaves)
    index = n.args[1] if n.target is operator.getitem else None
    return (n.target, str(spec), shape, index)


def find_recurrence(
    gm: fx.GraphModule, min_steps: int = 3, min_windows: int | None = None
) -> Recurrence | None:
    """The recurrence covering the most nodes of ``gm`` (None when there is none).
    ``min_windows``: a smaller minimum for a run whose steps read windows of an input
    (``narrow``s: a chunkwise recurrence, whose few chunks each hold many time steps)."""
    least = min(min_steps, min_windows or min_steps)
    seq = [n for n in gm.graph.nodes if n.op == "call_function"]
    sigs = [signature(n) for n in seq]
    last_at: dict[Any, int] = {}
    gaps: Counter[int] = Counter()
    for i, s in enumerate(sigs):
        if s in last_at:
            gaps[i - last_at[s]] += 1
        last_at[s] = i
    runs: list[tuple[int, int, int]] = []  # (coverage, start, period) of candidate runs
    # the most frequent gaps, and those covering the most nodes (count x gap): a long step
    # whose ops all recur within it (xLSTM's chunk: several adds, exps, slices per step) has
    # its own period as a gap only for its few unique ops, and few steps (4 chunks) make
    # that count smaller than the short gaps between the step's repeated ops
    frequent = [g for g, _ in gaps.most_common(MAX_PERIODS)]
    covering = sorted(gaps, key=lambda g: -gaps[g] * g)[:MAX_PERIODS]
    for period in dict.fromkeys(frequent + covering):
        i = 0
        while i + period < len(seq):
            if sigs[i] != sigs[i + period]:
                i += 1
                continue
            j = i
            while j + period < len(seq) and sigs[j] == sigs[j + period]:
                j += 1
            if (j - i + period) // period >= least:
                runs.append((j - i + period, i, period))
            i = j + 1
    for cover, start, period in sorted(runs, reverse=True):
        for phase in range(min(2 * period, cover)):
            steps = (cover - phase) // period
            if steps < least:
                break
            first = start + phase
            blocks = [seq[first + k * period : first + (k + 1) * period] for k in range(steps)]
            found = match(blocks)
            windows = found is not None and any(x.width > 0 for x in found.seq_of.values())
            if found is not None and (steps >= min_steps or windows):
                return found
    return None


def match(blocks: list[list[fx.Node]]) -> Recurrence | None:
    """The recurrence these blocks form, or None (see the module docstring)."""
    length = len(blocks[0])
    if any(mutates(n) and n.target != aten.copy_.default for n in blocks[0]):
        return None
    where = {n: (k, j) for k, block in enumerate(blocks) for j, n in enumerate(block)}
    kinds: list[list[tuple[Any, ...]]] = []
    states: dict[int, fx.Node] = {}
    timed: list[tuple[int, int]] = []  # (j, leaf) of step-indexed constants
    for j in range(length):
        nodes = [block[j] for block in blocks]
        if any(n.target != nodes[0].target for n in nodes):
            return None
        flat = [tree_flatten((n.args, n.kwargs)) for n in nodes]
        if any(spec != flat[0][1] for _, spec in flat):
            return None
        leaf_kinds = []
        for p in range(len(flat[0][0])):
            values = [leaves[p] for leaves, _ in flat]
            kind = _leaf_kind(values, where, j)
            if kind is None:
                return None
            if kind[0] == "carried" and states.setdefault(kind[1], kind[2]) is not kind[2]:
                return None
            if kind[0] == "time":
                timed.append((j, p))
            leaf_kinds.append(kind)
        kinds.append(leaf_kinds)
    rec = Recurrence(blocks, kinds, states)
    if not _per_step_inputs(rec, timed) or not step_writes(rec) or not rec.seq_of:
        return None
    return rec if _outputs(rec, where) else None


def _leaf_kind(values: list[Any], where: dict[fx.Node, tuple[int, int]], j: int):
    first = values[0]
    if all(isinstance(v, fx.Node) for v in values):
        at = [where.get(v) for v in values]
        if at[0] is not None and at[0][1] < j and all(a == (k, at[0][1]) for k, a in enumerate(at)):
            return ("internal", at[0][1])
        if at[0] is None and all(v is first for v in values):
            return ("invariant", first)
        if (
            at[0] is None
            and len(values) > 1
            and at[1] is not None
            and all(a == (k - 1, at[1][1]) for k, a in enumerate(at) if k)
        ):
            return ("carried", at[1][1], first)
        return None
    if any(isinstance(v, fx.Node) for v in values):
        return None
    if all(type(v) is type(first) and v == first for v in values):
        return ("constant", first)
    if all(type(v) is int for v in values) and len(values) > 1:
        stride = values[1] - values[0]
        if stride and all(v == first + k * stride for k, v in enumerate(values)):
            return ("time", first, stride)
    return None


def _per_step_inputs(rec: Recurrence, timed: list[tuple[int, int]]) -> bool:
    """Each step-indexed constant is a select/slice index of an invariant source."""
    invariant = _invariant_nodes(rec)
    for j in sorted({j for j, _ in timed}):
        node, kinds = rec.blocks[0][j], rec.kinds[j]
        time_leaves = [p for p, kind in enumerate(kinds) if kind[0] == "time"]
        src_kind = kinds[0]
        if src_kind[0] == "internal" and src_kind[1] in invariant:
            _hoist(rec, src_kind[1])
        elif src_kind[0] != "invariant":
            return False
        dim = node.args[1]
        if not isinstance(dim, int):
            return False
        if node.target == aten.select.int and time_leaves == [2]:
            _, start, stride = kinds[2]
            width = 0
        elif (
            node.target == aten.slice.Tensor
            and time_leaves == [2, 3]
            and len(node.args) == 4
            and not node.kwargs
        ):
            _, start, stride = kinds[2]
            _, end, end_stride = kinds[3]
            width = end - start
            if end_stride != stride or width <= 0:
                return False
        else:
            return False
        src = node.args[0]
        assert isinstance(src, fx.Node)
        rec.seq_of[j] = SeqInput(src, dim, start, stride, width)
    return True


def _invariant_nodes(rec: Recurrence) -> set[int]:
    """Step nodes computed from invariants and constants only (the same in every step)."""
    found: set[int] = set()
    for j, kinds in enumerate(rec.kinds):
        if all(
            k[0] in ("invariant", "constant") or (k[0] == "internal" and k[1] in found)
            for k in kinds
        ):
            found.add(j)
    return found


def _hoist(rec: Recurrence, j: int) -> None:
    """Compute step node ``j`` (and what it reads in the step) once, before the loop."""
    if j in rec.hoisted:
        return
    rec.hoisted.add(j)
    for kind in rec.kinds[j]:
        if kind[0] == "internal":
            _hoist(rec, kind[1])


def _outputs(rec: Recurrence, where: dict[fx.Node, tuple[int, int]]) -> bool:
    """What leaves the run: the last step's values, and per-step values a stack/cat collects
    whole. Anything else reading an intermediate step rejects the run."""
    steps = rec.steps
    collected_js: set[int] = set()
    for j in range(len(rec.blocks[0])):
        column = [block[j] for block in rec.blocks]
        for k, n in enumerate(column):
            if j in rec.hoisted and k == 0:
                continue
            for user in n.users:
                if user in where:
                    continue
                if j in rec.hoisted:
                    return False
                order = _collects(user, column)
                if order is not None:
                    rec.collected[user] = (j, order)
                    collected_js.add(j)
                elif k == steps - 1:
                    if j not in rec.last:
                        rec.last.append(j)
                else:
                    return False
    return True


def _collects(user: fx.Node, column: list[fx.Node]) -> bool | None:
    """Whether ``user`` stacks/cats exactly ``column`` (False), or it reversed (True)."""
    if user.target not in COLLECTORS or not user.args or user.kwargs:
        return None
    items = user.args[0]
    if not isinstance(items, list | tuple) or len(items) != len(column):
        return None
    if all(a is b for a, b in zip(items, column, strict=True)):
        return False
    if all(a is b for a, b in zip(items, reversed(column), strict=True)):
        return True
    return None
