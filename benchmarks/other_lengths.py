"""Captured at 64 tokens, run at 17, 64 and 512: which modern-zoo families run, and their SQNR.

    cd benchmarks && PYTHONPATH=../src:. python other_lengths.py mamba,mamba2,ligru
    cd benchmarks && PYTHONPATH=../src:. python other_lengths.py mamba2,xlstm --dynamic
    cd benchmarks && PYTHONPATH=../src:. python other_lengths.py xlstm --fold --calibrate 512

Issue 29's line "a recurrence captured at length 64 runs at 17 and 512". Each model is
quantized once at the zoo's 64 tokens with the CPU backend (``--dynamic``: with
``dynamic_shapes`` marking the batch and token dimensions ``Dim.AUTO``), then run at each
length against float (plain SQNR of the output). ``--fold``: ``fold_loops=True`` (which also
frees a loop over chunks); ``--calibrate 512``: the calibration batches at 512 tokens (the
capture stays at 64), since a range calibrated on 64 tokens need not cover 512.
``scan_lengths.py`` times the lengths but quantizes again where the 64-token model refuses
one; this script says the refusal.
"""

from __future__ import annotations

import argparse
import inspect
import warnings

import modern_zoo
import torch
import zoo
from common import load_note, one_thread
from torch.export import Dim

import quantree as qt
from quantree.backends import CPU


def at(args: tuple, length: int) -> tuple:
    """The token inputs repeated or cut to ``length``."""
    return tuple(
        torch.cat([a] * (length // a.shape[1] + 1), 1)[:, :length]
        if a.dim() == 2 and a.shape[1] == 64
        else a
        for a in args
    )


def run(name: str, dynamic: bool, fold: bool | None = None, calibrate: int = 64) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    case = modern_zoo.build(name)
    model = case.model.eval()
    calib = [at(case.sample(gen), calibrate) for _ in range(8)]
    held = case.sample(gen)
    first = next(iter(inspect.signature(model.forward).parameters))
    time_dim = 1 if calib[0][0].dim() == 2 else 2
    shapes = {first: {0: Dim.AUTO, time_dim: Dim.AUTO}} if dynamic else None
    try:
        low = qt.quantize(model, case.sample(torch.Generator().manual_seed(1)), calib,
                          backend=CPU, progress=False, dynamic_shapes=shapes,
                          fold_loops=fold)  # fmt: skip
    except Exception as err:
        print(f"{name}: quantize fails: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return
    for length in (17, 64, 512):
        x = at(held, length)
        try:
            with torch.no_grad():
                got, ref = zoo.flat(low(*x)), zoo.flat(model(*x))
            print(f"{name} T{length}: runs, {float(qt.sqnr(ref, got)):.1f} dB", flush=True)
        except Exception as err:
            print(f"{name} T{length}: {type(err).__name__}: {str(err)[:200]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="comma-separated modern_zoo names")
    parser.add_argument("--dynamic", action="store_true", help="capture with dynamic_shapes")
    parser.add_argument("--fold", action="store_true", help="fold_loops=True")
    parser.add_argument("--calibrate", type=int, default=64, help="calibration tokens")
    args = parser.parse_args()
    for name in args.models.split(","):
        run(name, args.dynamic, True if args.fold else None, args.calibrate)
    print(load_note(), f"torch {torch.__version__}, one thread")


if __name__ == "__main__":
    zoo.import_model_libraries()
    one_thread()
    warnings.simplefilter("ignore")
    main()
