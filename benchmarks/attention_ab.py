"""Float attention blocks as one native call (``passes/attention.py``) and the q/k/v
projections as one linear (``passes/sibling_linears.py``), against the lowering without them.

    python benchmarks/attention_ab.py --models bert,gpt2,vit_tiny,transformer_encoder --runs 10

Per model (``peers.py``'s builders and data): one reference graph lowered twice, with the CPU
backend ("after": each float attention block one ``quantree.attention`` call, int16-input
linears of one input one call) and with ``cpu_backend(attention=False)`` ("before": the same
graph but for those), timed with
float eager in one process (``chains_ab.balanced_medians``: float first, the two after it in
alternating order), one thread, medians of process CPU time, ``--rounds`` rounds. The
columns say how many blocks were fused and linear16 calls before -> after, each side's SQNR
against float, and the largest
difference between the two sides' outputs on the held-out inputs.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from chains_ab import balanced_medians  # benchmarks/ is on the path
from common import load_note, one_thread

import quantree as qt
from quantree.backends import cpu_backend


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2,vit_tiny,transformer_encoder")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    print("| model | blocks fused | linear16 calls | float ms | before: CPU ratio "
          "| after: CPU ratio | after / before | SQNR before / after | max diff |\n"
          "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name in args.models.split(","):
        model, calib, held = peers.data(name)
        ref = qt.quantize(model, calib[0], calib, backend=None, progress=False)
        before = qt.lower(ref, cpu_backend(attention=False))
        after = qt.lower(ref, cpu_backend())
        fused = sum(1 for n in after.graph.nodes if str(n.target) == "quantree.attention.default")
        linears = [
            sum(1 for n in m.graph.nodes if str(n.target) == "quantree.linear16.default")
            for m in (before, after)
        ]
        with torch.no_grad():
            want = [peers.flat(model(*a)) for a in held]
            got_b = [peers.flat(before(*a)) for a in held]
            got_a = [peers.flat(after(*a)) for a in held]
        diff = max(float((a - b).abs().max()) for a, b in zip(got_a, got_b, strict=True))
        quality = f"{peers.sqnr(want, got_b):.1f} / {peers.sqnr(want, got_a):.1f} dB"
        for _ in range(args.rounds):
            ms = balanced_medians(model, before, after, held[0], args.runs)
            b, a = ms["before"] / ms["float"], ms["after"] / ms["float"]
            calls = f"{linears[0]} -> {linears[1]}"
            print(f"| {name} | {fused} | {calls} | {ms['float']:.2f} | {b:.3f}x | {a:.3f}x "
                  f"| {a / b:.3f} | {quality} | {diff:.1e} |", flush=True)  # fmt: skip
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    sys.exit(main())
