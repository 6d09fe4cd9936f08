"""A rank that stops before calibration's merge: the others raise ``MergeTimeout`` after
quantree's merge timeout (``QUANTREE_MERGE_TIMEOUT``), not torch's 30 minutes.

Two gloo processes, the default group made with torch's default timeout; rank 1 stops
(SIGSTOP: alive, connected, silent) instead of calibrating, and rank 0 calibrates with a
timeout of 3 s and writes what it raised.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import quantree as qt

WAIT_S = 120  # rank 0 imports torch and quantree (seconds on a loaded machine), then 3 s


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["QUANTREE_MERGE_TIMEOUT"] = "3"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )  # torch's default timeout
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    data = [(torch.randn(2, 4),) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())
    if rank == 1:
        Path(out, "stopping").write_text("")
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent ends it
        return
    started = time.monotonic()
    try:
        qt.calibrate(prepared, qt.shard(data), progress=False)
        outcome = "merged"
    except Exception as error:
        waited = time.monotonic() - started
        outcome = f"{type(error).__name__} after {waited:.0f} s: {error}"
    Path(out, "rank0.txt").write_text(outcome)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_stopped_rank_fails_the_merge_after_quantrees_timeout(tmp_path: Path) -> None:
    context = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    result = tmp_path / "rank0.txt"
    deadline = time.monotonic() + WAIT_S
    try:
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(10)
    assert result.exists(), f"rank 0 still waiting after {WAIT_S} s"
    outcome = result.read_text()
    assert outcome.startswith("MergeTimeout"), outcome
    assert int(outcome.split(" after ")[1].split(" s")[0]) < 60, outcome
    assert "after 3 s (quantree's merge timeout)" in outcome
    assert "QUANTREE_MERGE_TIMEOUT" in outcome


def test_the_timeout_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantree.core.observing.distributed import merge_timeout

    monkeypatch.setenv("QUANTREE_MERGE_TIMEOUT", "soon")
    with pytest.raises(qt.QuantreeError, match="QUANTREE_MERGE_TIMEOUT='soon'"):
        merge_timeout()
    monkeypatch.setenv("QUANTREE_MERGE_TIMEOUT", "42")
    assert merge_timeout() == 42.0
    monkeypatch.delenv("QUANTREE_MERGE_TIMEOUT")
    assert merge_timeout() == 600.0
