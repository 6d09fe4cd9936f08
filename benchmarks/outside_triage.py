"""Triage for outside models: many models in one process, each under a time limit.

    python benchmarks/outside_triage.py --timeout 200 --runs 5 hf_vit falcon nfnet_l0

Only capture -> prepare -> calibrate (2 batches) -> convert -> lower -> one forward, on one
small input per model, then (``--runs``) the CPU-time ratio of lowered to float over that
many interleaved rounds. One JSON line per model: the step reached, SQNR against float of
the lowered and reference outputs on that input (not input-dependent: a first look) and of
lowered against reference, the ratio, the ops left in float, or the error and where it was
raised. ``outside_models.py`` is the full quickstart (save/load, ONNX, inspect), one
process per model; this finds which models to look at first."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved_times, load_note, one_thread
from outside_models import build
from zoo import float_ops, outputs, warm_batch_norm


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = (ref - got).pow(2).sum().clamp_min(1e-30)
    return round(float(10 * torch.log10(ref.pow(2).sum() / noise)), 1)


class Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise Timeout("time limit reached")


def triage(name: str, runs: int) -> dict:
    import quantree as qt
    from quantree.backends import CPU

    row: dict = {"model": name}
    step = "build"
    try:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        case = build(name)
        case.model.eval()
        warm_batch_norm(case.model, case, gen)
        calib = [case.sample(gen) for _ in range(2)]
        held = [case.sample(gen)]
        want = outputs(case.model, held)[0]
        step = "capture"
        gm = qt.capture(case.model, calib[0])
        step = "prepare"
        prepared = qt.prepare(gm, qt.Int8Quantizer())
        step = "calibrate"
        qt.calibrate(prepared, calib, progress=False)
        step = "convert"
        ref = qt.convert(prepared)
        step = "lower"
        lowered = qt.lower(ref, CPU)
        step = "run"
        got, ref_got = outputs(lowered, held)[0], outputs(ref, held)[0]
        row |= {"sqnr": sqnr(want, got), "sqnr_ref": sqnr(want, ref_got)}
        row["lowered_vs_ref"] = sqnr(ref_got, got)
        row["left"] = dict(float_ops(lowered).most_common())
        if runs:
            args = held[0]
            variants = {"float": lambda: case.model(*args), "lowered": lambda: lowered(*args)}
            ms = interleaved_times(variants, runs, warmup=2)
            row["cpu_ratio"] = round(ms["lowered"][1] / ms["float"][1], 2)
            row["wall_ratio"] = round(ms["lowered"][0] / ms["float"][0], 2)
            row["float_cpu_ms"] = round(ms["float"][1], 1)
            row["load"] = load_note()
        step = "ok"
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
        frames = traceback.extract_tb(err.__traceback__)[-4:]
        row["where"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in frames]
    row["step"] = step
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--timeout", type=int, default=200, help="seconds per model")
    parser.add_argument("--runs", type=int, default=0, help="interleaved timed rounds")
    args = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    for name in args.models:
        started = time.perf_counter()
        signal.alarm(args.timeout)  # Python code only: a native call runs to its end first
        try:
            row = triage(name, args.runs)
        except Timeout:
            row = {"model": name, "step": "timeout", "error": f"over {args.timeout} s"}
        finally:
            signal.alarm(0)
        row["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
