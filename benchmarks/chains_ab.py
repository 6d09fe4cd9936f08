"""Chains of layers as one native call (``native/chains.py``) against the per-op forward.

    python benchmarks/chains_ab.py --models cnn,resnet18,mobilenet_v2 --runs 10

Per model (``peers.py``'s builders and data): one lowered model's graph in two fresh modules,
one running each chain as one native call ("after", ``run_chains_natively``) and one the
graph's own per-op forward ("before"), the same bound calls and buffer reads, interleaved with float
eager in one process, one thread, medians of process CPU time, ``--rounds`` rounds. Outputs
are checked bit-equal between the two on the held-out inputs. The chain column says how many
chains the graph has and how many ops they hold.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.fx as fx
from common import load_note, one_thread  # benchmarks/ is on the path

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.chains import find_chains, run_chains_natively
from quantree.backends.cpu.native.fast_attributes import read_buffers_directly


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet18,mobilenet_v2,squeezenet,crnn")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    print("| model | chains (ops) | float ms | before: CPU ratio | after: CPU ratio "
          "| after / before | bits equal |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name in args.models.split(","):
        model, calib, held = peers.data(name)
        lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
        # two fresh modules of the one lowered graph, made alike but for the chains (the
        # module lowering returned ran measurably faster than a fresh one on chainless
        # transformers, an A/A difference that would bias the comparison)
        before = read_buffers_directly(fx.GraphModule(lowered, lowered.graph))
        after = run_chains_natively(read_buffers_directly(fx.GraphModule(lowered, lowered.graph)))
        chains = find_chains(after.graph)
        with torch.no_grad():
            equal = all(
                torch.equal(peers.flat(after(*a)), peers.flat(before(*a)))
                for a in held
                for _ in (0, 1)
            )
        for _ in range(args.rounds):
            ms = peers.cpu_medians(
                {
                    "float": lambda m=model, x=held[0]: m(*x),
                    "before": lambda m=before, x=held[0]: m(*x),
                    "after": lambda m=after, x=held[0]: m(*x),
                },
                args.runs,
            )
            b, a = ms["before"] / ms["float"], ms["after"] / ms["float"]
            print(f"| {name} | {len(chains)} ({sum(len(c) for c in chains)}) | "
                  f"{ms['float']:.2f} | {b:.3f}x | {a:.3f}x | {a / b:.3f} | {equal} |",
                  flush=True)  # fmt: skip
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    sys.exit(main())
