"""Shared timing helpers for the benchmarks: one thread, interleaved runs, medians."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

NA = "n/a"


def one_thread() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def interleaved_medians(
    variants: dict[str, Callable[[], object]], runs: int, warmup: int = 5
) -> dict[str, float]:
    """Median milliseconds of each variant; every round runs each variant once, in turn.

    The order rotates from round to round, so no variant always runs right after the same
    neighbour (whose cache and predictor footprint it would otherwise always inherit).
    """
    return {name: wall for name, (wall, _) in interleaved_times(variants, runs, warmup).items()}


def interleaved_times(
    variants: dict[str, Callable[[], object]], runs: int, warmup: int = 5
) -> dict[str, tuple[float, float]]:
    """Median wall-clock and thread-CPU milliseconds of each variant, from the same rounds.

    On a shared machine a call is often descheduled midway: its wall time then counts other
    jobs' time slices, its thread CPU time does not (one thread: the work runs on the calling
    thread). The CPU-time ratio is the steadier figure under load; caches and the other
    hyperthread are still shared, so it is not load-free either.
    """
    names = list(variants)
    with torch.inference_mode():
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        wall: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(runs):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                start, start_cpu = time.perf_counter(), time.thread_time()
                variants[name]()
                cpu[name].append((time.thread_time() - start_cpu) * 1e3)
                wall[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in names}


def ratios_to_float(times: dict[str, tuple[float, float]]) -> str:
    """``interleaved_times``' result as one line: float's milliseconds, then every other
    variant's CPU and wall ratio to it (CPU first: the figure that holds under load)."""
    fw, fc = times["float"]
    cells = "; ".join(
        f"{k} {c / fc:.2f}x CPU {w / fw:.2f}x wall" for k, (w, c) in times.items() if k != "float"
    )
    return f"float {fc:.2f} ms CPU {fw:.2f} wall; {cells}"


def table(title: str, columns: list[str], rows: list[tuple[str, dict[str, float | None]]]) -> str:
    """Markdown table: absolute ms and the ratio to the first column."""
    lines = [f"| {title} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, ms in rows:
        base = ms[columns[0]]
        cells = []
        for col in columns:
            value = ms.get(col)
            if value is None or base is None:
                cells.append(NA)
            else:
                cells.append(f"{value:.2f} ms ({value / base:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"
