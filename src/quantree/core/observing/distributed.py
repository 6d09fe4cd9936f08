"""Calibration across processes: every observer's statistics merged over a process group.

Each rank of a ``torch.distributed`` group (gloo on CPU, e.g. started by ``torchrun``)
calibrates the same prepared model on its own shard of the data; ``merge_statistics`` then
leaves every rank with the statistics one process would have gathered from all shards in
rank order. How statistics combine is each observer kind's own business
(``Observer.merge``); this module makes sure the ranks agree first, so that no collective is
entered by some ranks and not others: it exchanges, in one message, whether each rank's
calibration failed, how many batches it fed, and a description of its observers. A failure
anywhere, or models that differ, raise on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from quantree.core.errors import QuantreeError
from quantree.core.observing.observers import Observer

T = TypeVar("T")


class RankFailed(QuantreeError):
    """Another rank's calibration failed, so no statistics were merged; ``rank`` says which."""

    def __init__(self, rank: int, world: int, message: str) -> None:
        super().__init__(
            f"calibration failed on rank {rank} of {world}, so no statistics were merged: {message}"
        )
        self.rank = rank


def in_process_group() -> bool:
    """Whether a process group of more than one process is running (so calibration merges)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard(data: Sequence[T]) -> Sequence[T]:
    """This process's contiguous block of ``data`` (all of it outside a process group).

    Rank r gets the r-th of ``world`` nearly equal blocks, so taken in rank order the shards
    are ``data`` in its own order: merged statistics are then exactly one process's on all
    of ``data``, order-dependent ones (the moving average) included. A rank may get an empty
    block when there are fewer batches than processes; it still takes part in the merge.
    """
    if not in_process_group():
        return data
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise QuantreeError(
            f"quantree.shard needs a sequence of batches (a list), got {type(data).__name__}; "
            "for a DataLoader give it a torch.utils.data.DistributedSampler(dataset, "
            "shuffle=False) instead (its shards interleave, see docs/calibration.md)"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    start, stop = (len(data) * rank) // world, (len(data) * (rank + 1)) // world
    return data[start:stop]


def observers(module: torch.nn.Module) -> list[tuple[str, Observer]]:
    """Every observer of ``module`` (nested graphs too), in a fixed order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, Observer)]


MERGE_TIMEOUT_S = 600.0
"""How long a rank waits for the others at the merge (they may still be calibrating their
shards) before it raises ``MergeTimeout``; ``QUANTREE_MERGE_TIMEOUT`` (seconds) sets another.
torch's own default, 30 minutes, would leave every rank hanging that long when one stopped."""


class MergeTimeout(QuantreeError):
    """The ranks did not all reach the merge of calibration statistics in time, or one of
    them left it: no statistics were merged."""


def merge_timeout() -> float:
    """The merge's timeout in seconds (``QUANTREE_MERGE_TIMEOUT``, else ``MERGE_TIMEOUT_S``)."""
    raw = os.environ.get("QUANTREE_MERGE_TIMEOUT", "").strip()
    try:
        seconds = float(raw) if raw else MERGE_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e9:
        raise QuantreeError(
            f"QUANTREE_MERGE_TIMEOUT={raw!r} is not a number of seconds above 0; unset it "
            f"for the default ({MERGE_TIMEOUT_S:g} s)"
        )
    return seconds


def _cpu_group() -> Any:
    """A gloo group over the default group's ranks, with quantree's merge timeout.

    Statistics live on the CPU (a NCCL world cannot carry them), and the default group's
    timeout is the user's (torch's default: 30 minutes), so the merge runs in a group of its
    own, made once per world and timeout (a collective: every rank calibrates, so every rank
    makes it).
    """
    default = id(dist.distributed_c10d._get_default_group())
    return _gloo_group(default, merge_timeout())


@functools.cache
def _gloo_group(default_group_id: int, seconds: float) -> Any:
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))


def _check_same_observers(mine: list[str], everyone: list[list[str]]) -> None:
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        differs = next(
            (i for i, (a, b) in enumerate(zip(reference, theirs, strict=False)) if a != b),
            min(len(reference), len(theirs)),
        )
        first = reference[differs] if differs < len(reference) else "nothing"
        other = theirs[differs] if differs < len(theirs) else "nothing"
        raise QuantreeError(
            f"rank {rank} calibrated a different prepared model from rank 0's "
            f"({len(theirs)} observers against {len(reference)}; observer {differs} is "
            f"{other!r} on rank {rank} and {first!r} on rank 0): every process must capture "
            "the same model with the same example inputs and prepare it with the same quantizer"
        )


def merge_statistics(module: torch.nn.Module) -> None:
    """Merge the statistics of every observer of ``module`` across processes; a collective.

    For a model calibrated by calling it (``quantree.calibrate`` merges by itself). Every
    rank must call it, those that observed nothing too. Outside a process group of two or
    more processes it does nothing.
    """
    _agree_and_merge(module, None, None)


def calibrate_across(module: torch.nn.Module, feed: Callable[[], int]) -> int:
    """Run ``feed`` (this rank's calibration, returning its batch count), then merge.

    An exception in ``feed`` is held until every rank has finished its own, then raised on
    its rank, and as :class:`RankFailed` on the others, before any statistic is merged.
    Returns the number of batches fed on all ranks together.
    """
    try:
        count, error = feed(), None
    except Exception as caught:
        count, error = 0, caught
    return _agree_and_merge(module, error, count)


def _agree_and_merge(module: torch.nn.Module, error: Exception | None, count: int | None) -> int:
    """``count`` None: batches were not counted (a model calibrated by calling it)."""
    if not in_process_group():
        if error is not None:
            raise error
        return count or 0
    world, rank = dist.get_world_size(), dist.get_rank()
    with _waiting(world, rank):
        group = _cpu_group()
    return _merge(module, error, count, group, world, rank)


@contextlib.contextmanager
def _waiting(world: int, rank: int) -> Iterator[None]:
    """Collectives whose failure (gloo's timeout, a peer that left: ``RuntimeError``,
    ``DistBackendError``) is a ``MergeTimeout`` naming the timeout and its setting."""
    try:
        yield
    except RuntimeError as failed:
        if isinstance(failed, QuantreeError):
            raise
        raise MergeTimeout(
            f"rank {rank} of {world} waited for the other ranks at the merge of calibration "
            f"statistics and gave up after {merge_timeout():g} s (quantree's merge timeout), "
            f"or a rank left ({type(failed).__name__}: {str(failed)[:300]}): no statistics "
            "were merged. Every rank must calibrate and reach the merge; a rank that stopped "
            "or died leaves the others here. If some ranks need longer to calibrate their "
            "shard, set QUANTREE_MERGE_TIMEOUT (seconds) above that"
        ) from failed


def _merge(
    module: torch.nn.Module,
    error: Exception | None,
    count: int | None,
    group: Any,
    world: int,
    rank: int,
) -> int:
    """The agreement and the merge, as collectives of ``group``."""
    found = observers(module)
    signatures = [f"{name}: {observer.merge_signature()}" for name, observer in found]
    message = None if error is None else f"{type(error).__name__}: {error}"
    reports: list[Any] = [None] * world
    with _waiting(world, rank):
        dist.all_gather_object(reports, (message, count, signatures), group=group)
    failed = [(r, report[0]) for r, report in enumerate(reports) if report[0] is not None]
    if error is not None:
        error.add_note(f"on rank {rank} of {world}; no statistics were merged")
        raise error
    if failed:
        raise RankFailed(failed[0][0], world, failed[0][1])
    _check_same_observers(signatures, [report[2] for report in reports])
    total = sum(report[1] or 0 for report in reports)
    if count is not None and not total:
        raise QuantreeError(
            f"calibration data gave 0 batches on every one of the {world} processes: give "
            "at least one argument tuple of representative inputs to one of them"
        )
    with _waiting(world, rank):
        for _, observer in found:
            observer.merge(group)
    return total
