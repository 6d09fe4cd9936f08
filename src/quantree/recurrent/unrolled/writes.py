"""A step that writes its result into its own slice of a buffer, as a collected output.

RecurrentGemma's RG-LRU preallocates its output and writes each step's state into it
(``out[:, t] = h``), which export records as a ``copy_`` into ``select(out, 1, t)``. A step
with a side effect is not a function of its inputs, so such a run folds only where the write
is provably an output: the buffer is a fresh tensor (no alias of another), the run writes it
whole, each step its own slice in step order (no overlap, no gap), and nothing reads it
before the run ends, not even the step writing it. Then the buffer after the run is the
``stack``/``cat`` of the written values, which the folded loop returns as it does a
``stack``'s. Anything else (another step's slice, a slice read in the step, a buffer read or
aliased before the run, overlapping or partial writes, a cast or broadcast in the write)
rejects the run, which stays unrolled and computes what the model does.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.fx as fx

from quantree.recurrent.unrolled.recurrence import Recurrence, SeqInput, StepWrite

aten = torch.ops.aten


def mutates(n: fx.Node) -> bool:
    """Whether ``n`` writes into a tensor: a step with a side effect is not a function of its
    inputs, so only the writes ``step_writes`` proves to be collected outputs fold."""
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def step_writes(rec: Recurrence) -> bool:
    """Turn each ``copy_`` of the step into a ``StepWrite``; False when one is not provably a
    collected output (see the module docstring), so the run stays unrolled."""
    first = rec.blocks[0]
    buffers: set[fx.Node] = set()
    for j, node in enumerate(first):
        if not mutates(node):
            continue
        kinds = rec.kinds[j]
        if len(node.args) != 2 or node.kwargs or kinds[0][0] != "internal":
            return False
        if kinds[1][0] != "internal" or kinds[1][1] in rec.hoisted:
            return False
        target = kinds[0][1]
        where = rec.seq_of.get(target)
        found = None if where is None else _buffer(rec, target)
        if where is None or found is None or found[0] in buffers:
            return False
        buffer, views = found
        # the copy's result, the written slice and the views to it are read by nothing else
        chain = [*views, target, j]
        for block in rec.blocks:
            if block[j].users or any(
                list(block[a].users) != [block[b]] for a, b in pairwise(chain)
            ):
                return False
        if not _fresh_and_written_whole(rec, where, buffer, chain[0], target, kinds[1][1]):
            return False
        buffers.add(buffer)
        rec.writes[j] = StepWrite(buffer, target, kinds[1][1], where, tuple(views))
    for write in rec.writes.values():
        del rec.seq_of[write.target]
        rec.hoisted.difference_update(write.views)  # erased with the steps: the write's path
    return True


def _buffer(rec: Recurrence, target: int) -> tuple[fx.Node, list[int]] | None:
    """The tensor outside the run that step node ``target`` cuts, through whole-tensor
    ``slice``s in the step (``out[:, t]`` is ``select(slice(out, 0, 0, max), 1, t)``); None
    when anything else stands between them."""
    views: list[int] = []
    j = target
    while True:
        kind = rec.kinds[j][0]
        if kind[0] == "invariant":
            return kind[1], views[::-1]
        if kind[0] != "internal" or kind[1] not in rec.hoisted:
            return None
        j = kind[1]
        node = rec.blocks[0][j]
        val = node.meta.get("val")
        src = node.args[0] if node.args else None
        if (
            node.target != aten.slice.Tensor
            or node.kwargs
            or not isinstance(src, fx.Node)
            or not isinstance(val, torch.Tensor)
            or src.meta.get("val") is None
            or val.shape != src.meta["val"].shape
            or (len(node.args) > 2 and node.args[2] not in (0, None))
            or (len(node.args) > 4 and node.args[4] != 1)
        ):
            return None
        views.append(j)


def _fresh_and_written_whole(
    rec: Recurrence, where: SeqInput, buffer: fx.Node, j: int, target: int, value: int
) -> bool:
    """Whether the buffer is a new tensor (no alias of another), read by nothing before the
    run ends but each step's path to its slice (step node ``j``), and written whole once
    (step ``k`` its own slice, no two steps the same), with values of the slice's shape and
    dtype (no cast or broadcast) at step node ``value``."""
    schema = getattr(buffer.target, "_schema", None)
    if buffer.op != "call_function" or schema is None or schema.is_mutable:
        return False
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return False
    paths = {block[j] for block in rec.blocks}
    order = {n: i for i, n in enumerate(buffer.graph.nodes)}
    end = order[rec.blocks[-1][-1]]
    if any(u not in paths and order[u] < end for u in buffer.users):
        return False
    want = rec.blocks[0][target].meta.get("val")
    got = rec.blocks[0][value].meta.get("val")
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return False
    if want.shape != got.shape or want.dtype != got.dtype or want.device != got.device:
        return False
    return covers(where, rec.steps)


def covers(seq: SeqInput, steps: int) -> bool:
    """Whether ``steps`` steps read (or write) all of the source's time dimension, in order,
    each its own slice."""
    size = seq.src.meta["val"].shape[seq.dim]
    if not isinstance(size, int):
        return False
    width = max(seq.width, 1)
    if seq.width and seq.width != abs(seq.stride):
        return False
    first = seq.start if seq.stride > 0 else size - width - seq.start
    return first == 0 and captured_steps(seq) == steps


def captured_steps(seq: SeqInput) -> int | None:
    size = seq.src.meta["val"].shape[seq.dim]
    return None if not isinstance(size, int) else (size - max(seq.width, 1)) // abs(seq.stride) + 1
