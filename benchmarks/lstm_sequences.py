"""Whole-mode LSTM: int8 against int16 input/output sequences, AMX on and off, one process.

    python benchmarks/lstm_sequences.py [--runs 15] [--shapes lstm_b1,lstm512,lstm_b32]

Each shape (``peers.py``'s LSTM rows) quantized twice with ``Int8Quantizer``:
``recurrent_sequence_dtype`` INT8 (main before branch ``lstmb1``) and INT16 (the default
since), both lowered to the CPU backend; each timed with the AMX GEMM (input projection,
steps of 16 rows and more) on and off (``qt_amx``), interleaved with float
``nn.LSTM``. Thread-CPU-time ratios to float (medians), SQNR against float on 4 held-out
inputs.
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
from common import interleaved_times, load_note, one_thread  # benchmarks/ is on the path
from peers import build

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.loader import library


def sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * math.log10(float(want.pow(2).sum() / (want - got).pow(2).sum()))


def with_amx(on: bool, call, x):  # type: ignore[no-untyped-def]
    library().qt_amx(int(on))
    return call(*x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--shapes", default="lstm_b1,lstm512,lstm_b32")
    args = parser.parse_args()
    one_thread()
    amx = bool(library().qt_amx(-1))
    print(f"AMX available: {amx}")
    print("| shape | float ms | sequences | SQNR dB | AMX off | AMX on |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        model, sample = build(name)
        g = torch.Generator().manual_seed(0)
        calib = [sample(g) for _ in range(8)]
        test = [sample(g) for _ in range(4)]
        x = calib[0]
        variants = {"float": functools.partial(model, *x)}
        quality = {}
        for dtype in (qt.QDtype.INT8, qt.QDtype.INT16):
            quantizer = qt.Int8Quantizer(recurrent_sequence_dtype=dtype)
            low = qt.quantize(model, x, calib, quantizer=quantizer, backend=CPU, progress=False)
            with torch.no_grad():
                want = torch.cat([model(*t).flatten() for t in test])
                got = torch.cat([low(*t).flatten() for t in test])
            quality[dtype.value] = sqnr(want, got)
            for on in (False, True) if amx else (False,):
                variants[f"{dtype.value} amx{int(on)}"] = functools.partial(with_amx, on, low, x)
        with torch.no_grad():
            times = interleaved_times(variants, args.runs)
        library().qt_amx(1)
        base = times["float"][1]
        for dtype in ("int8", "int16"):
            cells = [
                f"{times[k][1] / base:.3f}x" if k in times else "-"
                for k in (f"{dtype} amx0", f"{dtype} amx1")
            ]
            print(
                f"| {name} | {base:.2f} | {dtype} | {quality[dtype]:.1f} | "
                + " | ".join(cells)
                + " |"
            )
    print(f"\n{load_note()}; torch {torch.__version__}; {args.runs} interleaved rounds, thread CPU")


if __name__ == "__main__":
    main()
