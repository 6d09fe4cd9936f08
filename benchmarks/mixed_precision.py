"""Mixed precision: how many points ``qt.mixed_precision`` widens to meet a target SQNR.

Per model: the int8 recipe's output SQNR on the held-out calibration batches (min-max, the
default), then ``qt.mixed_precision`` asked for that plus 3 and plus 6 dB: the SQNR it
reached there, how many of the model's points it widened (to int16 / float), the trials
(prepare -> calibrate -> convert runs) and CPU seconds it took, and the SQNR of the chosen
reference graph on 8 further inputs it never saw (the zoo's input-dependent SQNR), so the
choice is checked off the batches that made it. One thread.

    PYTHONPATH=src python benchmarks/mixed_precision.py [crnn distilbert charlm]
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import quantree as qt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from accuracy_algorithms import distilbert, sqnr_on
from zoo import CRNN, Case, randn, warm_batch_norm


def rows(name: str, model: nn.Module, calib: list, new: list, quantizer: qt.Quantizer) -> None:
    score = sqnr_on(model, new)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = qt.mixed_precision(model, calib[0], calib, target_sqnr=-1e9, quantizer=quantizer)
        print(f"| {name} | {len(calib) - base.held_out_batches}+{base.held_out_batches} | "
              f"{base.quantized_db:.1f} dB | - | - | - | {score(base.reference):.1f} dB |",
              flush=True)  # fmt: skip
        for gain in (3.0, 6.0):
            start = time.process_time()
            try:
                r = qt.mixed_precision(
                    model, calib[0], calib, target_sqnr=base.quantized_db + gain,
                    quantizer=quantizer,
                )  # fmt: skip
            except qt.TargetUnreachable as err:
                print(f"| {name} | | +{gain:.0f} dB | unreachable: {err} | | | |")
                continue
            seconds = time.process_time() - start
            kinds = [p.value for _, p in r.widened]
            widened = ", ".join(f"{kinds.count(k)} {k}" for k in ("int16", "float") if k in kinds)
            if 0 < len(r.widened) <= 3:
                widened += " (" + ", ".join(f"`{point}`" for point, _ in r.widened) + ")"
            print(f"| {name} | | target {r.target_db:.1f} dB | {r.reached_db:.1f} dB | "
                  f"{widened or 'none'} of {r.points} | {r.trials} trials, {seconds:.0f} s | "
                  f"{score(r.reference):.1f} dB |", flush=True)  # fmt: skip


def zoo_like(name: str, model: nn.Module, sample: Callable, quantizer: qt.Quantizer) -> None:
    gen = torch.Generator().manual_seed(1)
    warm_batch_norm(model, Case(model, sample), gen)
    calib = [sample(gen) for _ in range(12)]
    new = [sample(gen) for _ in range(8)]
    rows(name, model, calib, new, quantizer)


def main(which: list[str]) -> None:
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}")
    print("| model | batches (calibrate+measure) | target | reached | widened | cost | "
          "new inputs |")  # fmt: skip
    print("| --- " * 7 + "|")
    if "crnn" in which:
        for mode in qt.RecurrentMode:
            torch.manual_seed(0)
            zoo_like(f"CRNN, {mode.value}", CRNN().eval(), randn(1, 1, 32, 128),
                     qt.Int8Quantizer(recurrent=mode))  # fmt: skip
    if "distilbert" in which:
        model, sample = distilbert()
        zoo_like("DistilBERT (2 layers, dim 128)", model, sample, qt.Int8Quantizer())
    if "charlm" in which:
        from quantree.workloads import batches, load_charlm, load_corpus

        model = load_charlm("lstm")
        train = load_corpus("train", max_chars=400_000)
        data = batches(train, 16, 128, 20, seed=0)
        calib, new = data[:12], data[12:20]
        rows("char-LM (whole)", model, calib, new, qt.Int8Quantizer())


if __name__ == "__main__":
    main(sys.argv[1:] or ["crnn", "distilbert", "charlm"])
