"""int16 or int8 inputs to the weighted layers: SQNR and CPU-time ratios, one process.

    python benchmarks/weighted_input_bits.py --models bert --runs 20

The default recipe feeds linears int16 inputs (``Int8Quantizer(weighted_inputs_dtype=...)``);
this lowers each model both ways and times both interleaved with float (``common``), so the
cost of the int16 planes and the SQNR they buy are read from the same run.
"""

from __future__ import annotations

import argparse
import warnings

import peers
import torch
import zoo
from common import interleaved_times, load_note, one_thread

import quantree as qt
from quantree.backends import CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert")
    parser.add_argument("--runs", type=int, default=20, help="0: SQNR only")
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    int8 = qt.Int8Quantizer(weighted_inputs_dtype=qt.QDtype.INT8)
    for name in args.models.split(","):
        model, calib, held = peers.data(name)
        ref = zoo.outputs(model, held)
        lowered = {
            "int16 inputs (default)": qt.quantize(model, calib[0], calib, backend=CPU,
                                                  progress=False),
            "int8 inputs": qt.quantize(model, calib[0], calib, backend=CPU, progress=False,
                                       quantizer=int8),
        }  # fmt: skip
        sqnr = {k: zoo.input_dependent_sqnr(ref, zoo.outputs(m, held)) for k, m in lowered.items()}
        line = f"{name}: " + "; ".join(f"{k} {v:.1f} dB" for k, v in sqnr.items())
        if args.runs:
            calls = {"float": lambda m=model, a=held[0]: m(*a)}
            calls |= {k: (lambda m=m, a=held[0]: m(*a)) for k, m in lowered.items()}
            times = interleaved_times(calls, args.runs, warmup=3)
            fw, fc = times["float"]
            line += " | " + "; ".join(
                f"{k} {w / fw:.2f}x wall, {c / fc:.2f}x CPU"
                for k, (w, c) in times.items()
                if k != "float"
            )
        print(line, flush=True)
    print(load_note(), f"torch {torch.__version__}, one thread")


if __name__ == "__main__":
    main()
