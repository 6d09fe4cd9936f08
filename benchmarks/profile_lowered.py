"""Where a lowered model's time goes: per op, per call, and the Python around the kernels.

    python benchmarks/profile_lowered.py --models cnn,resnet18,bert --runs 20
    python benchmarks/profile_lowered.py --zoo modern --models dprnn,hdemucs --nodes 10

Per model (``peers.py``'s builders, its first held-out input, one thread): the whole forward
of quantree's CPU-lowered model (process CPU time, median of ``--runs``), then each graph
node run on its own through an ``fx.Interpreter`` that times every call (median per node,
summed per op). ``kernels`` is the sum over nodes; ``around`` is forward minus that sum: the
generated forward's Python, argument handling that the timed call does not include, guards.
The op table names each op's share, its call count and the mean time per call, so a row
says whether time goes to a few large kernels (their speed matters) or many small calls
(their fixed cost does). ``--zoo modern`` takes the models from ``modern_zoo.py`` (issue 29's
families, whole mode or ``--mode cells``); ``--nodes N`` lists the N costliest nodes with
their output shapes, and ``--float`` the ops the lowered graph leaves float
(``float_report``), by op. ``--fold`` quantizes with ``fold_loops=True`` (a loop whose step
stays in Python is kept folded), ``--length N`` repeats the inputs' time dimension to ``N``
(captured there), and ``--inside`` then times the ops of each folded ``StepLoop``'s step the
same way (summed over its steps; an interpreter per step, so only the shares mean much).
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
from quantree.backends.cpu.passes.float_report import float_ops


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
    gm: fx.GraphModule, args: tuple, runs: int, nodes: list | None = None
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
        if nodes is not None:
            nodes.append((statistics.median(ms), node))
    ops = [(name, sum(ms), len(ms)) for name, ms in per_op.items()]
    return statistics.median(whole), sorted(ops, key=lambda r: -r[1])


def modern_data(name: str) -> tuple[torch.nn.Module, list[tuple], list[tuple]]:
    """A ``modern_zoo.py`` family as ``zoo.run_model`` builds it: model, calibration, held-out."""
    import modern_zoo
    import zoo

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    case = modern_zoo.build(name)
    case.model.eval()
    zoo.warm_batch_norm(case.model, case, gen)
    return case.model, [case.sample(gen) for _ in range(16)], [case.sample(gen) for _ in range(8)]


def shape_of(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    return ""


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet18,bert,lstm_b1,lstm512,deepspeech,crnn")
    parser.add_argument("--zoo", choices=("peers", "modern"), default="peers")
    parser.add_argument("--mode", choices=("whole", "cells"), default="whole")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=0, help="costliest nodes listed")
    parser.add_argument("--float", action="store_true", help="list the ops left float")
    parser.add_argument("--fold", action="store_true", help="fold_loops=True")
    parser.add_argument("--length", type=int, default=0, help="time steps (zoo's if 0)")
    parser.add_argument("--inside", action="store_true", help="time the folded steps' ops")
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    mode = qt.RecurrentMode.CELLS if args.mode == "cells" else qt.RecurrentMode.WHOLE
    for name in args.models.split(","):
        model, calib, held = (modern_data if args.zoo == "modern" else peers.data)(name)
        if args.length:
            from scan_lengths import longer

            calib, held = ([longer(a, args.length) for a in c] for c in (calib, held))
        lowered = qt.quantize(
            model, calib[0], calib, quantizer=qt.Int8Quantizer(recurrent=mode), backend=CPU,
            progress=False, fold_loops=True if args.fold else None,
        )  # fmt: skip
        with torch.inference_mode():
            float_ms = statistics.median(
                [_cpu(lambda m=model, a=held[0]: m(*a)) for _ in range(max(3, args.runs // 2))]
            )
        costly: list = []
        whole, ops = profile(lowered, held[0], args.runs, costly)
        kernels = sum(ms for _, ms, _ in ops)
        calls = sum(n for _, _, n in ops)
        print(f"\n### {name}: forward {whole:.2f} ms ({whole / float_ms:.2f}x float "
              f"{float_ms:.2f} ms), {calls} calls, nodes {kernels:.2f} ms, "
              f"around them {whole - kernels:.2f} ms\n")  # fmt: skip
        print("| op | ms | share | calls | ms per call |\n|---|---|---|---|---|")
        for op, ms, n in ops[: args.top]:
            print(f"| {op} | {ms:.3f} | {ms / kernels:.0%} | {n} | {ms / n:.3f} |")
        if args.nodes:
            print("\n| node | op | output | ms |\n|---|---|---|---|")
            for ms, node in sorted(costly, key=lambda r: -r[0])[: args.nodes]:
                print(f"| {node.name} | {op_name(node, lowered)} | {shape_of(node)} | {ms:.3f} |")
        if args.float:
            left = collections.Counter(str(n.target) for _, n, _ in float_ops(lowered))
            print(
                f"\nleft float ({sum(left.values())}): "
                + ", ".join(f"{op} {k}" for op, k in left.most_common())
            )
        if args.inside:
            inside(lowered, held[0], args.runs, args.top)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


class _TimedBody(torch.nn.Module):
    def __init__(self, timed: Timed) -> None:
        super().__init__()
        self.timed = timed

    def forward(self, *args: Any) -> Any:
        return self.timed.run(*args)


def inside(lowered: fx.GraphModule, args: tuple, runs: int, top: int) -> None:
    """Each folded Python ``StepLoop``'s step, op by op, summed over its steps and calls."""
    from quantree.recurrent.unrolled.step_loop import StepLoop

    for name, loop in lowered.named_modules():
        if not isinstance(loop, StepLoop):
            continue
        body, timed = loop.body, Timed(loop.body)
        loop.body = _TimedBody(timed)  # type: ignore[assignment]
        try:
            with torch.inference_mode():
                for _ in range(runs):
                    lowered(*args)
        finally:
            loop.body = body
        per_op: dict[str, list[float]] = collections.defaultdict(list)
        for node, ms in timed.ms.items():
            per_op[op_name(node, body)].append(sum(ms) / runs)
        total = sum(sum(v) for v in per_op.values())
        print(f"\n{name}: {len(timed.ms)} step ops, {total:.3f} ms a forward in its steps\n")
        print("| op | ms a forward | share | ops in the step |\n|---|---|---|---|")
        for op, ms in sorted(per_op.items(), key=lambda r: -sum(r[1]))[:top]:
            print(f"| {op} | {sum(ms):.3f} | {sum(ms) / total:.0%} | {len(ms)} |")


def _cpu(fn: Any) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


if __name__ == "__main__":
    main()
