"""Chains of layers as one native call (``native/chains.py``) against the per-op forward.

    python benchmarks/chains_ab.py --models cnn,resnet18,mobilenet_v2 --runs 10

Per model (``peers.py``'s builders and data): one lowered model's graph in two fresh modules,
one running each chain as one native call ("after", ``run_chains_natively``) and one the
graph's own per-op forward ("before"), the same bound calls and buffer reads, interleaved with
float eager in one process (``balanced_medians``), one thread, medians of process CPU time,
``--rounds`` rounds. Outputs
are checked bit-equal between the two on the held-out inputs. The chain column says how many
chains the graph has and how many ops they hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.fx as fx
from common import load_note, one_thread  # benchmarks/ is on the path

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.chains import find_chains, run_chains_natively
from quantree.backends.cpu.native.fast_attributes import read_buffers_directly


def balanced_medians(model: torch.nn.Module, before: torch.nn.Module, after: torch.nn.Module,
                     x: tuple, runs: int) -> dict[str, float]:  # fmt: skip
    """Median process-CPU ms of each, ``runs`` rounds: float first, then before and after in
    alternating order, so each of the two follows float (whose weights evict the caches)
    equally often. (``peers.cpu_medians``' rotation put "before" after float in two rounds of
    three: chainless models, the same code in both columns, read 10% faster "after".)"""
    calls = {"float": model, "before": before, "after": after}
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for fn in calls.values():
            fn(*x)
            fn(*x)
        for r in range(2 * runs):
            for name in ("float", "before", "after") if r % 2 else ("float", "after", "before"):
                start = time.process_time()
                calls[name](*x)
                times[name].append((time.process_time() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def report_rows(name, model, before, after, held, rounds: int, runs: int) -> None:
    """One table row per round: ``before`` and ``after`` (the same graph, chains run natively
    in ``after``) timed interleaved with float, and whether their outputs are bit-equal."""
    import peers  # as main() does: it imports every model library

    chains = find_chains(after.graph)
    with torch.no_grad():
        equal = all(
            torch.equal(peers.flat(after(*a)), peers.flat(before(*a))) for a in held for _ in (0, 1)
        )
    for _ in range(rounds):
        ms = balanced_medians(model, before, after, held[0], runs)
        b, a = ms["before"] / ms["float"], ms["after"] / ms["float"]
        print(f"| {name} | {len(chains)} ({sum(len(c) for c in chains)}) | "
              f"{ms['float']:.2f} | {b:.3f}x | {a:.3f}x | {a / b:.3f} | {equal} |",
              flush=True)  # fmt: skip


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
        report_rows(name, model, before, after, held, args.rounds, args.runs)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    sys.exit(main())
