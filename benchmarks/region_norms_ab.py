"""Large layer norms and gelus in region programs (branch ``h-bertln``), before and after, in
one process.

    python benchmarks/region_norms_ab.py --models bert,gpt2,vit_tiny --rounds 40

One reference graph lowered twice: "before" with the region pass's old size limit (layer
norms and gelus over ``FLOAT_MAX_ELEMENTS`` values left to ATen), "after" with this
machine's limit (none on the AVX-512 path: ``regions.float_limit``). Timed with float eager
first in every round and the two after it in alternating order, one thread, medians of
process CPU time; the calls each lowering makes, and the outputs' SQNR to float and
difference between the two.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import warnings

import torch
from common import load_note, one_thread  # benchmarks/ is on the path

import quantree as qt
import quantree.backends.cpu.passes.regions as regions
from quantree.backends import cpu_backend


def _sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    noise = (want - got).pow(2).mean().item()
    return float("inf") if noise == 0 else 10 * torch.log10(want.pow(2).mean() / noise).item()


def _calls(gm: torch.fx.GraphModule) -> str:
    c = collections.Counter(
        str(n.target).split(".")[-2] if "." in str(n.target) else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and "getitem" not in str(n.target)
    )
    keep = ("program", "linear16", "layer_norm", "gelu", "add", "attention")
    return ", ".join(f"{k} {c[k]}" for k in keep if c[k])


def _first(out: object) -> torch.Tensor:
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))  # type: ignore[union-attr]
    return out


def run(model_name: str, rounds: int) -> None:
    import peers

    model, calib, held = peers.data(model_name)
    ref = qt.quantize(model, calib[0], calib, backend=None, progress=False)
    limit = regions.float_limit
    regions.float_limit = lambda: float(regions.FLOAT_MAX_ELEMENTS)  # type: ignore[assignment]
    try:
        before = qt.lower(ref, cpu_backend())
    finally:
        regions.float_limit = limit  # type: ignore[assignment]
    after = qt.lower(ref, cpu_backend())
    calls = {"float": model, "before": before, "after": after}
    times: dict[str, list[float]] = {name: [] for name in calls}
    x = held[0]
    with torch.inference_mode():
        outs = {name: _first(fn(*x)) for name, fn in calls.items()}
        for fn in calls.values():
            fn(*x)
        for r in range(rounds):
            for name in ["float", *(("before", "after") if r % 2 else ("after", "before"))]:
                start = time.process_time()
                calls[name](*x)
                times[name].append((time.process_time() - start) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    diff = (outs["before"] - outs["after"]).abs().max().item()
    print(
        f"| {model_name} | {_calls(before)} | {_calls(after)} | {ms['float']:.2f} | "
        f"{ms['before'] / ms['float']:.3f}x | {ms['after'] / ms['float']:.3f}x | "
        f"{ms['after'] / ms['before']:.3f} | {_sqnr(outs['float'], outs['before']):.1f} / "
        f"{_sqnr(outs['float'], outs['after']):.1f} dB | {diff:.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2,vit_tiny")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    print(
        "| model | calls before | calls after | float ms | before | after | after / before "
        "| SQNR to float before / after | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        run(name, args.rounds)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    sys.exit(main())
