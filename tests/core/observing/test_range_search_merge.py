"""ObserverKind.SEARCH across processes: the merge is exact, not approximately one process.

The histograms sit on a power-of-two grid anchored at 0 (see ``quantree.core.observing.search``),
so the counts after any sequence of batches are those of all the values on the final grid:
feeding the batches one by one equals feeding them all at once, bit for bit, and two gloo
processes that each observed half of the batches merge to exactly one process's statistics
(histograms, both halves, range, grid, counters) and so exactly its scale, zero point and
choice.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import quantree as qt
from quantree.core.observing.kinds import make_observer

WORLD = 2
STATE = ("min_val", "max_val", "histogram", "odd", "exponent", "num_calls", "num_values")


def _cases() -> list[tuple[bool, list[torch.Tensor]]]:
    """(symmetric, batches): ranges that grow on both sides, shrink, and sit far from 0."""
    g = torch.Generator().manual_seed(7)
    growing = [torch.randn(300, generator=g) * (1 + (i * 3) % 5) for i in range(7)]
    tails = [torch.randn(500, generator=g) / torch.rand(500, generator=g) for _ in range(5)]
    offset = [1000.0 + torch.rand(200, generator=g) * (i + 1) for i in range(4)]
    positive = [torch.randn(100, generator=g).exp() * 10.0**i for i in range(-3, 4)]
    return [
        (False, growing),
        (True, growing),
        (False, tails),
        (False, offset),
        (True, positive),
    ]


def _observer(symmetric: bool) -> Any:
    spec = qt.QuantSpec(qt.QDtype.INT8, symmetric=symmetric, observer=qt.ObserverKind.SEARCH)
    return make_observer(spec, "x")


def _result(observer: Any) -> dict[str, Any]:
    p = observer.qparams()
    found = {name: getattr(observer, name).clone() for name in STATE}
    return {**found, "scale": p.scale, "zero_point": p.zero_point, "choice": observer.choice}


def _one_process(symmetric: bool, batches: list[torch.Tensor]) -> dict[str, Any]:
    observer = _observer(symmetric)
    for x in batches:
        observer(x)
    return _result(observer)


def _worker(rank: int, port: int, out: str) -> None:
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    results = []
    try:
        for symmetric, batches in _cases():
            observer = _observer(symmetric)
            half = (len(batches) + 1) // 2  # an odd count: rank 1 starts at an odd position
            for x in batches[:half] if rank == 0 else batches[half:]:
                observer(x)
            observer.merge()
            results.append(_result(observer))
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_equal(got: dict[str, Any], want: dict[str, Any], case: int) -> None:
    for name, value in want.items():
        same = (
            torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value
        )
        assert same, f"case {case} {name}: {got[name]} merged, {value} in one process"


def test_batches_one_by_one_count_as_all_at_once() -> None:
    """The grid and counts depend on the values only, not on how batches fell."""
    for case, (symmetric, batches) in enumerate(_cases()):
        by_batch, whole = _observer(symmetric), _observer(symmetric)
        for x in batches:
            by_batch(x)
        whole(torch.cat(batches))
        for name in ("min_val", "max_val", "histogram", "exponent", "num_values"):
            assert torch.equal(getattr(by_batch, name), getattr(whole, name)), (case, name)


def test_two_shards_merge_to_exactly_one_process(tmp_path: Path) -> None:
    mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for case, (symmetric, batches) in enumerate(_cases()):
        want = _one_process(symmetric, batches)
        for rank in ranks:
            _assert_equal(rank[case], want, case)


@pytest.mark.parametrize("symmetric", [False, True])
def test_the_grid_holds_every_value_in_bins_bins(symmetric: bool) -> None:
    observer = _observer(symmetric)
    for _, batches in _cases():
        for x in batches:
            observer(x)
        edges = observer._edges()
        assert float(edges[0]) <= float(observer.min_val)
        assert float(edges[-1]) > float(observer.max_val)
        assert float(observer.histogram.sum()) == int(observer.num_values)
