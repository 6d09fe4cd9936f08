"""quantree's lowered CNNs against ExecuTorch XNNPACK: whole model, per node, per layer.

    python benchmarks/conv_vs_xnnpack.py --models cnn,resnet18 --reps 20 --runs 15

Per model (``peers.py``'s builders, one thread): quantree's CPU-lowered model and ExecuTorch
XNNPACK's int8 model (its own ``XNNPACKQuantizer``, per channel), timed interleaved with float
eager, each sample a loop of ``--reps`` calls (a call of the small CNN is tens of
microseconds: one call per sample measures the clock). Then every node of the lowered graph
timed on its own with its recorded arguments (the same ``DirectCall``/``BoundCall`` the
forward makes, so the Python entry is in the figure), summed per op. quantree runs twice:
as this branch does (GEMMs on AMX tiles where the CPU offers them and the product is large,
kernel calls kept per input shape) and as main does (AVX-512 VNNI, ``qt_amx(0)``; each call
deriving its kernel arguments, ``plans_kept = 0``), same bits. Then each distinct
convolution of the model as a one-layer model (conv, or conv + ReLU as the model has it)
through both: quantree's node call on int8 NHWC data against XNNPACK's whole one-layer
program minus its quantize/dequantize (measured as an identity-conv-free program: the
one-layer program's q/dq timed on their own), so a row compares kernel against kernel.
Medians of thread CPU time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from common import load_note, one_thread  # benchmarks/ is on the path
from peers import build, et_call
from torch import fx, nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.bound_calls import BoundConv2d, BoundLinear
from quantree.backends.cpu.native.loader import library


def timed(fns: dict[str, Callable[[], Any]], reps: int, runs: int) -> dict[str, float]:
    """Median thread-CPU ms per call of each function, interleaved, ``reps`` calls a sample."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    with torch.inference_mode():
        for fn in fns.values():
            for _ in range(3):
                fn()
        for r in range(runs):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                fn = fns[name]
                start = time.thread_time()
                for _ in range(reps):
                    fn()
                samples[name].append((time.thread_time() - start) * 1e3 / reps)
    return {k: statistics.median(v) for k, v in samples.items()}


def recorded_calls(gm: fx.GraphModule, args: tuple) -> list[tuple[fx.Node, Callable[[], Any]]]:
    """Each call node of ``gm`` as a thunk on the arguments it received in one forward."""
    env: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            env[n] = out
            return out

    with torch.inference_mode():
        Recorder(gm).run(*args)
    calls = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_module", "call_method"):
            continue
        a = fx.node.map_arg(n.args, lambda v: env[v])
        k = fx.node.map_arg(n.kwargs, lambda v: env[v])
        if n.op == "call_function":
            fn = n.target
        elif n.op == "call_module":
            fn = gm.get_submodule(str(n.target))
        else:
            continue
        calls.append((n, lambda fn=fn, a=a, k=k: fn(*a, **k)))
    return calls


def op_name(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"module {n.target}"
    name = getattr(n.target, "__name__", str(n.target))
    return name.removeprefix("quantree_backends_cpu_native_direct_").removesuffix("_default")


class OneConv(nn.Module):
    def __init__(self, conv: nn.Conv2d, relu: bool) -> None:
        super().__init__()
        self.conv, self.relu = conv, relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return torch.relu(y) if self.relu else y


def convs_with_relu(model: nn.Module, example: tuple) -> list[tuple[nn.Conv2d, tuple, bool]]:
    """Each distinct (shape, stride, input size) convolution and whether a ReLU follows it."""
    found: dict[tuple, tuple[nn.Conv2d, tuple, bool]] = {}
    order: list[nn.Conv2d] = []
    inputs: dict[nn.Conv2d, torch.Size] = {}

    def hook(mod: nn.Module, inp: tuple, out: Any) -> None:
        order.append(mod)
        inputs[mod] = inp[0].shape

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(*example)
    for h in handles:
        h.remove()
    for conv in order:
        key = (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.groups,
               tuple(inputs[conv]))  # fmt: skip
        found.setdefault(key, (conv, (torch.randn(inputs[conv]),), True))
    return list(found.values())


KEPT = BoundConv2d.plans_kept


def mode(branch: bool) -> None:
    """This branch's kernel path (AMX, kernel calls kept per shape) or main's."""
    library().qt_amx(int(branch))
    BoundConv2d.plans_kept = BoundLinear.plans_kept = KEPT if branch else 0


def whole(name: str, reps: int, runs: int) -> None:
    from executorch_runtime import et_int8

    model, sample = build(name)
    g = torch.Generator().manual_seed(0)
    calib = [sample(g) for _ in range(8)]
    args = calib[0]
    lowered = qt.quantize(model, args, calib, backend=CPU, progress=False)
    et = et_call(et_int8(model, args, calib))
    t = timed({"float": lambda: model(*args), "quantree": lambda: (mode(True), lowered(*args)),
               "vnni": lambda: (mode(False), lowered(*args)), "et": lambda: et(args)},
              reps, runs)  # fmt: skip
    mode(True)
    print(f"\n### {name}: whole model, ms per call (ratio to float)\n")
    print("| float | quantree | quantree as on main (VNNI, no kept calls) | et xnnpack "
          "| quantree / et |\n|---|---|---|---|---|")  # fmt: skip
    ratio = {k: f"{v:.3f} ({v / t['float']:.2f}x)" for k, v in t.items()}
    print(f"| {t['float']:.3f} | {ratio['quantree']} | {ratio['vnni']} | {ratio['et']} "
          f"| {t['quantree'] / t['et']:.2f} |")  # fmt: skip
    calls = recorded_calls(lowered, args)
    per = timed({str(i): fn for i, (_, fn) in enumerate(calls)}, reps, max(5, runs // 3))
    by_op: dict[str, list[float]] = collections.defaultdict(list)
    for i, (n, _) in enumerate(calls):
        by_op[op_name(n)].append(per[str(i)])
    total = sum(per.values())
    print(f"\nnodes, each timed alone: sum {total:.3f} ms over {len(calls)} calls; "
          f"forward minus the sum {t['quantree'] - total:+.3f} ms\n")  # fmt: skip
    print("| op | calls | ms | share | ms per call |\n|---|---|---|---|---|")
    for op, ms in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {op} | {len(ms)} | {sum(ms):.3f} | {sum(ms) / total:.0%} | "
              f"{sum(ms) / len(ms):.4f} |")  # fmt: skip
    per_layer(model, args, reps, runs)


def per_layer(model: nn.Module, example: tuple, reps: int, runs: int) -> None:
    from executorch_runtime import et_int8

    print("\nper convolution (+ReLU), one-layer models, ms per call: quantree's conv node on "
          "int8 NHWC; ExecuTorch's whole one-layer program (q, conv, dq) and the same for "
          "quantree's whole one-layer model\n")  # fmt: skip
    print("| conv | in | quantree node | node, VNNI only | quantree model | et model "
          "| model ratio |\n|---|---|---|---|---|---|---|")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for conv, (x,), relu in convs_with_relu(model, example):
        one = OneConv(conv, relu).eval()
        calib = [(torch.randn(x.shape, generator=g),) for _ in range(4)]
        lowered = qt.quantize(one, calib[0], calib, backend=CPU, progress=False)
        et = et_call(et_int8(one, calib[0], calib))
        node = next(fn for n, fn in recorded_calls(lowered, calib[0]) if "conv2d" in op_name(n))
        amx, a = library().qt_amx, calib[0]
        t = timed({"node": lambda amx=amx, f=node: (amx(1), f()),
                   "vnni": lambda amx=amx, f=node: (amx(0), f()),
                   "qt": lambda amx=amx, m=lowered, a=a: (amx(1), m(*a)),
                   "et": lambda f=et, a=a: f(a)}, reps, runs)  # fmt: skip
        amx(1)
        shape = (f"{conv.in_channels}->{conv.out_channels} k{conv.kernel_size[0]} "
                 f"s{conv.stride[0]} g{conv.groups}")  # fmt: skip
        print(f"| {shape} | {tuple(x.shape[1:])} | {t['node']:.4f} | {t['vnni']:.4f} | "
              f"{t['qt']:.4f} | "
              f"{t['et']:.4f} | {t['qt'] / t['et']:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="cnn,resnet18")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=15)
    opts = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore")
    for name in opts.models.split(","):
        whole(name, opts.reps, opts.runs)
    print("\n" + load_note())


if __name__ == "__main__":
    main()
