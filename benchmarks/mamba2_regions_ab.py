"""Mamba-2's chunked SSD in whole-model region programs: before / after in one process.

    cd benchmarks && PYTHONPATH=../src:. python mamba2_regions_ab.py

``scan_lengths.py``'s Mamba-2 (``modern_zoo``'s builder and seeds, 16 calibration and 8
held-out inputs), quantized to its reference graph once per length (64, and 512 captured at
512: the model's capture fixes the length), then lowered twice: ``before`` with
``region_strided.MAX_ELEMENTS = 0`` (no math or strided op joins a whole model's program:
main's regions) and ``after`` (this branch). The input-dependent SQNR of both, their graph
call counts, then float eager and both timed interleaved, one thread, two runs.
"""

from __future__ import annotations

import warnings

import modern_zoo
import torch
import zoo
from common import interleaved_times, load_note, one_thread, ratios_to_float

import quantree as qt
import quantree.backends.cpu.passes.instructions.region_strided as region_strided
from quantree.backends import CPU
from quantree.pipeline import lower


def longer(args: tuple, length: int) -> tuple:
    return tuple(
        torch.cat([a] * (length // a.shape[1]), 1) if a.dim() >= 2 and a.shape[1] == 64 else a
        for a in args
    )


def main() -> None:
    for length in (64, 512):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        case = modern_zoo.build("mamba2")
        model = case.model.eval()
        calib = [longer(case.sample(gen), length) for _ in range(16)]
        held = [longer(case.sample(gen), length) for _ in range(8)]
        ref = qt.quantize(model, calib[0], calib, backend="reference", progress=False)
        keep = region_strided.MAX_ELEMENTS
        region_strided.MAX_ELEMENTS = 0  # main's whole-model regions
        lows = {"before": lower(ref, CPU)}
        region_strided.MAX_ELEMENTS = keep
        lows["after"] = lower(ref, CPU)
        with torch.no_grad():
            want = [zoo.flat(model(*h)) for h in held]
            for name, low in lows.items():
                got = [zoo.flat(low(*h)) for h in held]
                calls = sum(1 for n in low.graph.nodes if n.op == "call_function")
                print(f"T{length} {name}: SQNR {zoo.input_dependent_sqnr(want, got):.1f} dB, "
                      f"{calls} graph calls", flush=True)  # fmt: skip
            x = held[0]
            timed = {"float": lambda model=model, x=x: model(*x)}
            timed |= {k: (lambda m=m, x=x: m(*x)) for k, m in lows.items()}
            for run in (1, 2):
                ms = interleaved_times(timed, 7 if length == 64 else 5, warmup=2)
                print(f"  T{length} run {run}: {ratios_to_float(ms)} ({load_note()})", flush=True)


if __name__ == "__main__":
    zoo.import_model_libraries()
    one_thread()
    warnings.simplefilter("ignore")
    main()
