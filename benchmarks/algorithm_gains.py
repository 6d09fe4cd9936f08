"""Issue 27's table: each accuracy algorithm's gain per zoo model, and its time.

Per zoo model (the zoo's data: 16 calibration batches, 8 held-out inputs, input-dependent
SQNR), on the reference graph (lowering computes the same integers), each algorithm switched
off alone against ``Int8Quantizer()``'s default without refine:

- range search: the default (``ObserverKind.SEARCH`` on int8 activations) against
  ``activation_observer=MINMAX``; time: calibration CPU seconds of each;
- refine: ``qt.refine`` (default ``Refine()``) on the default's reference graph; time: its
  CPU seconds (``qt.quantize`` runs it by default on transformer-like graphs only);
- int16 tables: the default table choice against ``embedding_dtype=INT8`` (models with an
  ``nn.Embedding`` only);
- int16 conv1d weights: the default against ``conv1d_weight_dtype=INT8`` (models with an
  ``nn.Conv1d`` only).

Recurrent models in whole mode. One thread.

    cd benchmarks && PYTHONPATH=../src:. python algorithm_gains.py --models resnet18,bert
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

import torch
from common import load_note, one_thread
from torch import nn
from zoo import MODELS, build, flat, input_dependent_sqnr, one_line, warm_batch_norm

import quantree as qt

INT8 = qt.QDtype.INT8


def reference(model: nn.Module, calib: list, **options: Any) -> tuple[Any, Any, float]:
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.WHOLE, **options)
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, calib[0]), quantizer)
        qt.calibrate(prepared, calib, progress=False)
        ref = qt.convert(prepared)
    return prepared, ref, time.process_time() - start


def row(name: str) -> str:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    case = build(name)
    model = case.model.eval()
    warm_batch_norm(model, case, gen)
    calib = [case.sample(gen) for _ in range(16)]
    held = [case.sample(gen) for _ in range(8)]
    with torch.no_grad():
        want = [flat(model(*a)) for a in held]

    def score(q: Any) -> float:
        torch.manual_seed(1000)  # Tacotron2's prenet draws dropout masks in eval mode
        with torch.no_grad():
            return input_dependent_sqnr(want, [flat(q(*a)) for a in held])

    prepared, ref, cal_s = reference(model, calib)
    base = score(ref)
    cells = [f"{base:.1f} dB ({cal_s:.1f} s)"]
    _, mm, mm_s = reference(model, calib, activation_observer=qt.ObserverKind.MINMAX)
    cells.append(f"{base - score(mm):+.1f} dB ({cal_s:.1f} s vs {mm_s:.1f} s)")
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refined = qt.refine(prepared, ref, calib)
    ref_s = time.process_time() - start
    cells.append(f"{score(refined) - base:+.1f} dB (+{ref_s:.1f} s)")
    for kind, option in ((nn.Embedding, "embedding_dtype"), (nn.Conv1d, "conv1d_weight_dtype")):
        if not any(isinstance(m, kind) for m in model.modules()):
            cells.append("-")
            continue
        _, other, other_s = reference(model, calib, **{option: INT8})
        cells.append(f"{base - score(other):+.1f} dB ({cal_s:.1f} s vs {other_s:.1f} s)")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    args = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore", category=UserWarning)
    print(f"{load_note()}, torch {torch.__version__}, one thread")
    print("| model | default, no refine (calibration CPU s) | range search vs min-max "
          "| refine | int16 tables vs int8 | int16 conv1d weights vs int8 |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        try:
            print(row(name.strip()), flush=True)
        except Exception as err:  # a model that fails is a row, not the end of the table
            print(f"| {name} | fails: {one_line(err)} | | | | |", flush=True)
    print(load_note(), file=sys.stderr)


if __name__ == "__main__":
    main()
