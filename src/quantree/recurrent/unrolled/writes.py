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

xLSTM's chunkwise mLSTM keeps the state *entering* each chunk: step ``k`` writes the state it
received into slot ``k`` of a buffer one slot longer than the run, and the last slot is
written after the loop with the final state. That buffer is the initial state followed by the
state each step passes on, which the loop collects like any per-step value. It folds only
when the steps write slots ``0 .. T-1`` in order, one write right after the run puts the last
step's state into slot ``T`` through the same kind of view, and nothing reads the buffer
before that write; any other slot, value or read keeps the run unrolled.
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
        carried = kinds[1][0] == "carried"  # the state the step received (see above)
        if not carried and (kinds[1][0] != "internal" or kinds[1][1] in rec.hoisted):
            return False
        value = kinds[1][1]
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
        closing: tuple[fx.Node, ...] = ()
        if carried:
            found_closing = _closing_write(rec, where, buffer, chain, value)
            if found_closing is None:
                return False
            closing = found_closing
        if not _fresh_and_written_whole(rec, where, buffer, chain[0], target, value, closing):
            return False
        buffers.add(buffer)
        initial = rec.states[value] if carried else None
        rec.writes[j] = StepWrite(buffer, target, value, where, tuple(views), initial, closing)
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
    rec: Recurrence,
    where: SeqInput,
    buffer: fx.Node,
    j: int,
    target: int,
    value: int,
    closing: tuple[fx.Node, ...] = (),
) -> bool:
    """Whether the buffer is a new tensor (no alias of another), read by nothing before the
    run ends (or before the ``closing`` write) but each step's path to its slice (step node
    ``j``), and written whole once (step ``k`` its own slice, no two steps the same; with a
    closing write, steps ``0 .. T-1`` and it slot ``T``), with values of the slice's shape
    and dtype (no cast or broadcast) at step node ``value``."""
    schema = getattr(buffer.target, "_schema", None)
    if buffer.op != "call_function" or schema is None or schema.is_mutable:
        return False
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return False
    paths = {block[j] for block in rec.blocks} | set(closing[:1])
    order = {n: i for i, n in enumerate(buffer.graph.nodes)}
    end = order[closing[-1] if closing else rec.blocks[-1][-1]]
    if any(u not in paths and order[u] < end for u in buffer.users):
        return False
    want = rec.blocks[0][target].meta.get("val")
    got = rec.blocks[0][value].meta.get("val")
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return False
    if want.shape != got.shape or want.dtype != got.dtype or want.device != got.device:
        return False
    if closing:  # slots 0 .. T-1 by the steps, slot T (the last) by the closing write
        return where.stride > 0 and covers(where, rec.steps + 1)
    return covers(where, rec.steps)


def _closing_write(
    rec: Recurrence, where: SeqInput, buffer: fx.Node, chain: list[int], value: int
) -> tuple[fx.Node, ...] | None:
    """The write right after the run of the last step's state ``value`` into the buffer's
    last slot (``buf[:, -1] = h``, ``buf[..., -d:, :] = C``), through whole-tensor slices
    like the steps' own (``chain``: their views, the slot and the ``copy_``): its nodes, the
    ``copy_`` last; None when the first use of the buffer after the run is anything else."""
    run_end = rec.blocks[-1][-1]
    order = {n: i for i, n in enumerate(buffer.graph.nodes)}
    after = sorted((u for u in buffer.users if order[u] > order[run_end]), key=order.__getitem__)
    if not after:
        return None
    size = buffer.meta.get("val")
    size = None if not isinstance(size, torch.Tensor) else size.shape[where.dim]
    if not isinstance(size, int):
        return None
    slot = rec.steps * where.stride  # the first index of slot T
    nodes: list[fx.Node] = []
    node = after[0]
    source = buffer
    for j in chain:
        step_node = rec.blocks[0][j]
        if node.target != step_node.target or node.kwargs or node.args[0] is not source:
            return None
        nodes.append(node)
        if j == chain[-1]:  # the copy_: of the last step's state, read by nothing
            if node.users or node.args[1] is not rec.blocks[-1][value]:
                return None
            break
        if j != chain[-2] and node.args[1:] != step_node.args[1:]:  # a whole-tensor slice
            return None
        if j == chain[-2] and not _is_slot(node, where, slot, size):
            return None
        if len(node.users) != 1:
            return None
        source, node = node, next(iter(node.users))
    return tuple(nodes)


def _is_slot(node: fx.Node, where: SeqInput, slot: int, size: int) -> bool:
    """Whether ``node`` cuts index ``slot`` (``select``) or ``slot .. slot + width`` (``slice``)
    of dimension ``where.dim``, counting negative indices from the end as ATen does."""
    args = node.args
    if len(args) < 3 or args[1] != where.dim or not isinstance(args[2], int):
        return False
    start = args[2] + size if args[2] < 0 else args[2]
    if node.target == aten.select.int and where.width == 0:
        return len(args) == 3 and start == slot
    if node.target != aten.slice.Tensor or where.width == 0 or len(args) > 5:
        return False
    end = args[3] if len(args) > 3 else None
    end = size if end is None else end
    if not isinstance(end, int) or (len(args) > 4 and args[4] != 1):
        return False
    end = end + size if end < 0 else min(end, size)
    return start == slot and end == slot + where.width == size


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
