"""BERT's two lowering changes of branch ``h-attn26`` measured apart, in one process.

    python benchmarks/attention_split.py --rounds 60

One reference graph lowered three ways: "before" (``cpu_backend(attention=False)``),
"attention" (the float attention blocks as ``quantree.attention`` calls, the q/k/v linears
still three calls: ``merge_sibling_linears`` switched off while lowering) and "both" (the
default). Timed with float eager first in every round and the three after it in changing
order, one thread, medians of process CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
from common import load_note, one_thread  # benchmarks/ is on the path

import quantree as qt
import quantree.backends.cpu.backend as cpu
from quantree.backends import cpu_backend


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    model, calib, held = peers.data(args.model)
    ref = qt.quantize(model, calib[0], calib, backend=None, progress=False)
    before = qt.lower(ref, cpu_backend(attention=False))
    both = qt.lower(ref, cpu_backend())
    joined = cpu.merge_sibling_linears
    cpu.merge_sibling_linears = lambda gm: 0  # type: ignore[assignment]
    try:
        attention = qt.lower(ref, cpu_backend())
    finally:
        cpu.merge_sibling_linears = joined
    calls = {"float": model, "before": before, "attention": attention, "both": both}
    orders = (["before", "attention", "both"], ["both", "attention", "before"],
              ["attention", "both", "before"])  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in calls}
    x = held[0]
    with torch.inference_mode():
        for fn in calls.values():
            fn(*x)
            fn(*x)
        for r in range(args.rounds):
            for name in ["float", *orders[r % 3]]:
                start = time.process_time()
                calls[name](*x)
                times[name].append((time.process_time() - start) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    cells = " | ".join(f"{ms[n] / ms['float']:.3f}x" for n in ("before", "attention", "both"))
    print(f"| {args.model} | {ms['float']:.2f} | {cells} |")
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    sys.exit(main())
