"""Calibration across processes: 2 gloo processes on halves of the data against 1 on all of it.

A model with an LSTM (whole and cells mode) under every observer kind (weights always per
channel min-max). Expected equality, per kind:

- min-max (per tensor and per channel): statistics and parameters identical, bit for bit;
- moving average: identical too, because the merge replays every rank's per-batch extremes in
  rank order and ``quantree.shard`` gives contiguous blocks (one process's order);
- range search: identical too, because its histograms sit on a power-of-two grid anchored at 0
  whose counts do not depend on how the batches fell (exact re-binning);
- histogram: the range (min, max) identical; the counts differ only by re-binning, so the
  chosen clipping range may move to a neighbouring candidate of the 64-point search grid:
  each end within one grid step (1/64 of the observed range on that side) plus one
  quantization step.

Both ranks must also end with identical statistics. The workers write their results to files
and the test compares them with a single-process calibration done here.
"""

from __future__ import annotations

import functools
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import quantree as qt
from quantree.core.observing.distributed import observers

WORLD = 2
TIMEOUT_S = 180
KINDS = list(qt.ObserverKind)
MODES = list(qt.RecurrentMode)
CONFIGS = [(mode, kind) for mode in MODES for kind in KINDS]
TWICE = [qt.ObserverKind.MOVING_AVERAGE, qt.ObserverKind.HISTOGRAM, qt.ObserverKind.SEARCH]


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor):
        out, (h, c) = self.lstm(torch.relu(self.inp(x)))
        return self.head(out), (h, c)


def _model() -> Tagger:
    torch.manual_seed(0)
    return Tagger().eval()


def _data(n: int = 7) -> list[tuple[torch.Tensor]]:
    """Batches whose ranges grow and shrink, so order and re-binning matter."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 5, 6, generator=g) * (1 + (i * 3) % 5),) for i in range(n)]


@functools.cache
def _captured() -> torch.fx.GraphModule:
    return qt.capture(_model(), _data(1)[0])  # prepare copies it: one capture serves all


def _prepared(mode: qt.RecurrentMode, kind: qt.ObserverKind) -> torch.fx.GraphModule:
    return qt.prepare(_captured(), qt.Int8Quantizer(recurrent=mode, activation_observer=kind))


def _statistics(prepared: torch.nn.Module) -> dict[str, Any]:
    """Every observer's statistics and parameters (nested cell graphs included)."""
    found = {}
    for name, observer in observers(prepared):
        p = observer.qparams()
        found[name] = {
            "min": observer.min_val.clone(),
            "max": observer.max_val.clone(),
            "scale": p.scale.clone(),
            "zero_point": p.zero_point.clone(),
            "batches": int(observer.num_batches),
            "range": p.quant_min,
            "range_max": p.quant_max,
            "kind": type(observer).__name__,
        }
    return found


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    results: dict[str, Any] = {}
    try:
        data = _data()
        for mode, kind in CONFIGS:
            prepared = _prepared(mode, kind)
            total = qt.calibrate(prepared, qt.shard(data), progress=False)
            results[f"{mode.value}/{kind.value}"] = (_statistics(prepared), total)
        # a rank with no batch still takes part (1 batch: rank 0's shard is empty)
        prepared = _prepared(qt.RecurrentMode.WHOLE, qt.ObserverKind.MINMAX)
        qt.calibrate(prepared, qt.shard(data[:1]), progress=False)
        results["empty_shard"] = _statistics(prepared)
        # calibrating twice counts nothing twice
        for kind in TWICE:
            prepared = _prepared(qt.RecurrentMode.WHOLE, kind)
            qt.calibrate(prepared, qt.shard(data[:4]), progress=False)
            qt.calibrate(prepared, qt.shard(data[4:]), progress=False)
            results[f"twice/{kind.value}"] = _statistics(prepared)
        # running the prepared model after a merge keeps the merged statistics on every rank
        prepared = _prepared(qt.RecurrentMode.WHOLE, qt.ObserverKind.MINMAX)
        qt.calibrate(prepared, qt.shard(data), progress=False)
        with torch.no_grad():
            prepared(*data[0])
        results["run_after_merge"] = _statistics(prepared)
        # one rank's bad batch fails every rank, before anything is merged
        prepared = _prepared(qt.RecurrentMode.WHOLE, qt.ObserverKind.MINMAX)
        bad = [(torch.full((2, 5, 6), float("nan")),)] if rank == 1 else data[:2]
        results["failure"] = _error(lambda: qt.calibrate(prepared, bad, progress=False))
        # different models on the ranks
        mode = qt.RecurrentMode.CELLS if rank == 1 else qt.RecurrentMode.WHOLE
        prepared = _prepared(mode, qt.ObserverKind.MINMAX)
        results["mismatch"] = _error(lambda: qt.calibrate(prepared, qt.shard(data), progress=False))
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _error(call: Any) -> tuple[str, str]:
    try:
        call()
    except qt.QuantreeError as error:
        return type(error).__name__, str(error)
    return "", ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _single(mode: qt.RecurrentMode, kind: qt.ObserverKind, *batches: list) -> dict[str, Any]:
    prepared = _prepared(mode, kind)
    for data in batches:
        qt.calibrate(prepared, data, progress=False)
    return _statistics(prepared)


def _one_process() -> dict[str, Any]:
    """What one process gets from all the data, for every case the workers run."""
    data = _data()
    found: dict[str, Any] = {f"{m.value}/{k.value}": _single(m, k, data) for m, k in CONFIGS}
    found["empty_shard"] = _single(qt.RecurrentMode.WHOLE, qt.ObserverKind.MINMAX, data[:1])
    for kind in TWICE:
        found[f"twice/{kind.value}"] = _single(qt.RecurrentMode.WHOLE, kind, data[:4], data[4:])
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(each rank's results, one process's), the latter computed while the ranks run."""
    out = tmp_path_factory.mktemp("ranks")
    context = mp.start_processes(
        _worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        single = _one_process()
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {WORLD} calibration processes took over {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return ranks, single


def _assert_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        for field, value in want[name].items():
            other = got[name][field]
            same = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
            assert same, f"{name} {field}: {other} across processes, {value} in one"


def _clip_range(stats: dict[str, Any]) -> tuple[float, float]:
    scale, zp = float(stats["scale"]), int(stats["zero_point"])
    return (stats["range"] - zp) * scale, (stats["range_max"] - zp) * scale


def _assert_histograms_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if w["kind"] != "HistogramObserver":
            _assert_identical({name: g}, {name: w})
            continue
        assert torch.equal(g["min"], w["min"]) and torch.equal(g["max"], w["max"]), name
        assert g["batches"] == w["batches"], name
        (g_lo, g_hi), (w_lo, w_hi) = _clip_range(g), _clip_range(w)
        lo_step = -min(float(w["min"]), 0.0) / 64 + float(w["scale"])
        hi_step = max(float(w["max"]), 0.0) / 64 + float(w["scale"])
        assert abs(g_lo - w_lo) <= lo_step * 1.0001, (name, g_lo, w_lo, lo_step)
        assert abs(g_hi - w_hi) <= hi_step * 1.0001, (name, g_hi, w_hi, hi_step)


def test_every_rank_ends_with_the_same_statistics(runs: Any) -> None:
    ranks, _ = runs
    twice = [f"twice/{k.value}" for k in TWICE]
    for key in [f"{m.value}/{k.value}" for m, k in CONFIGS] + ["empty_shard", *twice]:
        first, second = ranks[0][key], ranks[1][key]
        if isinstance(first, tuple):
            assert first[1] == second[1] == len(_data()), key  # batches over both ranks
            first, second = first[0], second[0]
        _assert_identical(second, first)


@pytest.mark.parametrize(
    ("mode", "kind"), CONFIGS, ids=[f"{m.value}-{k.value}" for m, k in CONFIGS]
)
def test_two_processes_give_one_process_parameters(
    runs: Any, mode: qt.RecurrentMode, kind: qt.ObserverKind
) -> None:
    ranks, single = runs
    got, _ = ranks[0][f"{mode.value}/{kind.value}"]
    want = single[f"{mode.value}/{kind.value}"]
    if kind == qt.ObserverKind.HISTOGRAM:  # re-bins approximately
        _assert_histograms_close(got, want)
    else:
        _assert_identical(got, want)
    assert {s["kind"] for s in want.values()} >= {"MinMaxObserver"}  # the weights, per channel


def test_a_rank_without_batches_takes_part(runs: Any) -> None:
    ranks, single = runs
    _assert_identical(ranks[0]["empty_shard"], single["empty_shard"])


def test_calibrating_twice_counts_nothing_twice(runs: Any) -> None:
    ranks, single = runs
    for key in ("twice/moving_average", "twice/search"):
        _assert_identical(ranks[0][key], single[key])
    _assert_histograms_close(ranks[0]["twice/histogram"], single["twice/histogram"])


def test_running_after_a_merge_keeps_the_merged_statistics(runs: Any) -> None:
    """A batch run after the merge (within the merged ranges) changes no parameter."""
    ranks, single = runs

    def without_counts(found: dict[str, Any]) -> dict[str, Any]:
        return {
            name: {k: v for k, v in stats.items() if k != "batches"}
            for name, stats in found.items()
        }

    for rank in ranks:
        _assert_identical(
            without_counts(rank["run_after_merge"]), without_counts(single["whole/minmax"])
        )


def test_a_failure_on_one_rank_fails_every_rank(runs: Any) -> None:
    ranks, _ = runs
    kind, message = ranks[1]["failure"]
    assert kind == "BadBatch" and "NaN" in message
    kind, message = ranks[0]["failure"]
    assert kind == "RankFailed" and "rank 1 of 2" in message and "NaN" in message


def test_different_models_on_the_ranks_are_refused(runs: Any) -> None:
    ranks, _ = runs
    for rank in ranks:
        kind, message = rank["mismatch"]
        assert kind == "QuantreeError", message
        assert "rank 1 calibrated a different prepared model" in message
        assert "same quantizer" in message
