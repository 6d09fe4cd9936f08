"""w4a8 on the char-LM: bits/char, saved size and latency against float and int8.

Rows: float; int8 (the default recipe); w4a8 with min-max ranges (``qt.W4A8Quantizer()``);
w4a8 with range search for activations and weights plus ``qt.refine``. Bits/char on
validation text, read on the reference graph (lowering computes the same integers); saved
sizes of the CPU-lowered models (``quantree.backends.save``); latency of the lowered int8 and
w4a8 models on one batch, one thread, interleaved, CPU and wall time, two runs.

    PYTHONPATH=src python benchmarks/w4a8_charlm.py ["w4a8 groups of 32, search + refine" ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import torch

import quantree as qt
from quantree.backends import CPU, save
from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus

SEARCH = qt.ObserverKind.SEARCH


def reference(model, calib, quantizer, refine):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, calib[0]), quantizer)
        qt.calibrate(prepared, calib, progress=False)
        ref = qt.convert(prepared)
        return qt.refine(prepared, ref, calib) if refine else ref


def timed(fn, x, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn(x)
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    torch.set_num_threads(1)
    model = load_charlm("lstm")
    validation = load_corpus("validation")[:50_001]
    train = load_corpus("train", max_chars=400_000)
    calib = batches(train, 16, 128, 20, seed=0)
    base = bits_per_char(model, validation, 128, 16)
    variants = {
        "int8": (qt.Int8Quantizer(), False),
        "w4a8 min-max": (qt.W4A8Quantizer(), False),
        "w4a8 search + refine": (
            qt.W4A8Quantizer(activation_observer=SEARCH, weight_observer=SEARCH),
            True,
        ),
        **{
            f"w4a8 groups of {g}, search + refine": (
                qt.W4A8Quantizer(activation_observer=SEARCH, weight_observer=SEARCH, group_size=g),
                True,
            )
            for g in (16, 32, 64)
        },
        **{
            f"w4a8 groups of {g}, min-max + refine": (qt.W4A8Quantizer(group_size=g), True)
            for g in (32,)
        },
    }
    chosen = sys.argv[1:] or list(variants)  # names to run (int8 always: the size reference)
    variants = {k: v for k, v in variants.items() if k == "int8" or k in chosen}
    print(f"load: {os.getloadavg()}")
    print("| model | bits/char | vs float | saved bytes | vs int8 |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| float | {base:.4f} | - | - | - |")
    lowered, sizes = {}, {}
    for name, (quantizer, refine) in variants.items():
        ref = reference(model, calib, quantizer, refine)
        bpc = bits_per_char(ref, validation, 128, 16)
        low = qt.lower(ref, CPU)
        with tempfile.TemporaryDirectory() as tmp:
            save(low, f"{tmp}/m.pt2", calib[0])
            sizes[name] = os.path.getsize(f"{tmp}/m.pt2")
        lowered[name] = low
        print(f"| {name} | {bpc:.4f} | {100 * (bpc / base - 1):+.2f}% | {sizes[name]} | "
              f"{sizes[name] / sizes['int8']:.2f}x |", flush=True)  # fmt: skip
    (x,) = calib[0]
    for run in (1, 2):
        totals = {name: [0.0, 0.0] for name in lowered}
        for _ in range(5):  # interleaved
            for name in totals:
                cpu, wall = timed(lowered[name], x, 4)
                totals[name][0] += cpu
                totals[name][1] += wall
        c8, w8 = totals["int8"]
        for name, (c4, w4) in totals.items():
            if name != "int8":
                print(f"run {run}: {name} / int8 latency, one thread, batch {tuple(x.shape)}: "
                      f"CPU {c4 / c8:.3f}, wall {w4 / w8:.3f} (int8 {1000 * c8 / 20:.1f} ms CPU "
                      f"a call); load {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
