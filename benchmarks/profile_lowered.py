"""Where a lowered model's time goes: per op, per call, and the Python around the kernels.

    python benchmarks/profile_lowered.py --models cnn,resnet18,bert --runs 20

Per model (``peers.py``'s builders, its first held-out input, one thread): the whole forward
of quantree's CPU-lowered model (process CPU time, median of ``--runs``), then each graph
node run on its own through an ``fx.Interpreter`` that times every call (median per node,
summed per op). ``kernels`` is the sum over nodes; ``around`` is forward minus that sum: the
generated forward's Python, argument handling that the timed call does not include, guards.
The op table names each op's share, its call count and the mean time per call, so a row
says whether time goes to a few large kernels (their speed matters) or many small calls
(their fixed cost does).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import warnings
from typing import Any

import torch
from common import load_note, one_thread
from torch import fx

import quantree as qt
from quantree.backends import CPU


def op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return f"module {type(gm.get_submodule(str(node.target))).__name__}"
    target = node.target
    name = getattr(target, "__name__", str(target))
    if node.op == "call_method":
        return f"method {target}"
    return name.removesuffix("_default").removesuffix(".default")


class Timed(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.ms: dict[fx.Node, list[float]] = collections.defaultdict(list)

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        start = time.process_time()
        out = super().run_node(n)
        self.ms[n].append((time.process_time() - start) * 1e3)
        return out


def profile(
    gm: fx.GraphModule, args: tuple, runs: int
) -> tuple[float, list[tuple[str, float, int]]]:
    with torch.inference_mode():
        for _ in range(3):
            gm(*args)
        whole = []
        for _ in range(runs):
            start = time.process_time()
            gm(*args)
            whole.append((time.process_time() - start) * 1e3)
        timed = Timed(gm)
        for _ in range(runs):
            timed.run(*args)
    per_op: dict[str, list[float]] = collections.defaultdict(list)
    for node, ms in timed.ms.items():
        per_op[op_name(node, gm)].append(statistics.median(ms))
    ops = [(name, sum(ms), len(ms)) for name, ms in per_op.items()]
    return statistics.median(whole), sorted(ops, key=lambda r: -r[1])


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet18,bert,lstm_b1,lstm512,deepspeech,crnn")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    for name in args.models.split(","):
        model, calib, held = peers.data(name)
        lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
        with torch.inference_mode():
            float_ms = statistics.median(
                [_cpu(lambda m=model, a=held[0]: m(*a)) for _ in range(max(3, args.runs // 2))]
            )
        whole, ops = profile(lowered, held[0], args.runs)
        kernels = sum(ms for _, ms, _ in ops)
        calls = sum(n for _, _, n in ops)
        print(f"\n### {name}: forward {whole:.2f} ms ({whole / float_ms:.2f}x float "
              f"{float_ms:.2f} ms), {calls} calls, nodes {kernels:.2f} ms, "
              f"around them {whole - kernels:.2f} ms\n")  # fmt: skip
        print("| op | ms | share | calls | ms per call |\n|---|---|---|---|---|")
        for op, ms, n in ops[: args.top]:
            print(f"| {op} | {ms:.3f} | {ms / kernels:.0%} | {n} | {ms / n:.3f} |")
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


def _cpu(fn: Any) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


if __name__ == "__main__":
    main()
