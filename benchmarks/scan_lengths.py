"""The modern zoo's scan families at 64 and 512 tokens, captured at 64.

    cd benchmarks && PYTHONPATH=../src:. python scan_lengths.py mamba,ligru default,unrolled
    cd benchmarks && PYTHONPATH=../src:. python scan_lengths.py mamba2,recurrent_gemma,xlstm default

Per family (``modern_zoo``'s builders, its seeds; no ``warm_batch_norm``, so the SQNR can
differ from the zoo's table for models with batch norm): quantized for the CPU backend with
``qt.quantize``'s folding default (``default``), ``fold_loops=True`` (``fold``) or
``False`` (``unrolled``), or ``fold4``: ``fold_loops=True`` with the automatic fold's minimum
run lowered from ``AUTO_MIN_STEPS`` to 4 steps (a measurement: xLSTM's 4 chunks at 64
tokens); the input-dependent SQNR on the 8 held-out inputs; then float
eager and each variant timed interleaved in one process, one thread, at 64 tokens and at
512 (the held-out input repeated eight times), two runs, thread-CPU and wall ratios. A
variant whose capture fixed the length to 64 (no folded loop frees it) is quantized again
at 512 for the 512 rows, and the line says so. The unrolled variant runs at 64 only.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings

import modern_zoo
import torch
import zoo
from common import interleaved_times, load_note, one_thread, ratios_to_float

import quantree as qt
from quantree.backends import CPU

FOLD = {"default": None, "fold": True, "unrolled": False, "fold4": True}
MIN_STEPS = {"fold4": 4}


def quantize(model, args, calib, variant: str):
    """``qt.quantize`` for the variant (``MIN_STEPS``: the fold's minimum run, patched for the
    call only)."""
    import quantree.recurrent.capture as capture

    folding = capture.fold_and_free
    if variant in MIN_STEPS:
        capture.fold_and_free = functools.partial(folding, min_steps=MIN_STEPS[variant])
    try:
        return qt.quantize(model, args, calib, backend=CPU, progress=False,
                           fold_loops=FOLD[variant])  # fmt: skip
    finally:
        capture.fold_and_free = folding


def longer(args: tuple, length: int) -> tuple:
    return tuple(
        torch.cat([a] * (length // a.shape[1]), 1) if a.dim() >= 2 and a.shape[1] == 64 else a
        for a in args
    )


def run(name: str, variants: list[str]) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    case = modern_zoo.build(name)
    model = case.model.eval()
    calib = [case.sample(gen) for _ in range(16)]
    held = [case.sample(gen) for _ in range(8)]
    lows = {}
    with torch.no_grad():
        ref = [zoo.flat(model(*h)) for h in held]
    for v in variants:
        start = time.time()
        lows[v] = quantize(model, calib[0], calib, v)
        loops = [type(m).__name__ for m in lows[v].modules() if "Loop" in type(m).__name__]
        with torch.no_grad():
            got = [zoo.flat(lows[v](*h)) for h in held]
        print(f"## {name} {v}: loops {loops}, SQNR {zoo.input_dependent_sqnr(ref, got):.1f} dB, "
              f"quantized in {time.time() - start:.0f} s", flush=True)  # fmt: skip
    for length in (64, 512):
        x = held[0] if length == 64 else longer(held[0], length)
        timed = {"float": lambda x=x: model(*x)}
        for v, low in lows.items():
            if length != 64 and v == "unrolled":
                continue
            try:
                with torch.no_grad():
                    low(*x)
            except Exception as err:  # the capture fixed the length
                print(f"  {name} {v} T{length}: {type(err).__name__}; captured again at "
                      f"{length}", flush=True)  # fmt: skip
                again = [longer(c, length) for c in calib]
                low = quantize(model, again[0], again, v)
            timed[v] = lambda x=x, low=low: low(*x)
        with torch.no_grad():
            for run_ in (1, 2):
                ms = interleaved_times(timed, 5 if length == 64 else 3, warmup=2)
                line = ratios_to_float({k: v for k, v in ms.items() if k == "float" or k in lows})
                print(f"  {name} T{length} run {run_}: {line} ({load_note()})", flush=True)


if __name__ == "__main__":
    zoo.import_model_libraries()
    one_thread()
    warnings.simplefilter("ignore")
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else ["default", "unrolled"]
    for family in sys.argv[1].split(","):
        run(family, chosen)
