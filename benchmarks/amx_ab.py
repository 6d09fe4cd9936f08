"""Branch `cnnspeed`'s effect on the zoo: one lowered model run as main runs it ("before": GEMMs
on AVX-512 VNNI, each conv2d / linear call deriving its kernel arguments) and as this branch
does ("after": AMX tiles where the CPU offers them and the product is large enough, kernel
calls kept per input shape), same process.

    python benchmarks/amx_ab.py --models resnet18,bert,mobilenet_v2 --runs 10

Per model (``zoo.py``'s builders, data and input-dependent SQNR against float): one model
lowered to the CPU backend, called with ``qt_amx(0)`` and no kept calls
(``plans_kept = 0``) or with ``qt_amx(1)`` and kept calls (``--amx-only``: the kept calls in
both), timed interleaved with float (medians of thread CPU time, ``--rounds`` whole
timings). The two columns run the same graph and give the same bits (checked here on the
held-out inputs), so they differ by the kernel alone.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import zoo
from common import interleaved_times, load_note, one_thread  # benchmarks/ is on the path

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.bound_calls import BoundConv2d, BoundLinear
from quantree.backends.cpu.native.loader import library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,bert,mobilenet_v2,vit_tiny,deepspeech")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--amx-only", action="store_true", help="kept calls in both columns")
    args = parser.parse_args()
    kept = BoundConv2d.plans_kept

    def mode(after: bool) -> None:
        amx(int(after))
        BoundConv2d.plans_kept = BoundLinear.plans_kept = kept if after or args.amx_only else 0

    one_thread()
    warnings.simplefilter("ignore")
    amx = library().qt_amx
    if amx(-1) != 1:
        sys.exit("no AMX on this CPU or OS: nothing to compare")
    print("| model | before: CPU ratio | after: CPU ratio | after / before | SQNR |")
    print("|---|---|---|---|---|")
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        case = zoo.build(model_name)
        case.model.eval()
        zoo.warm_batch_norm(case.model, case, gen)
        calib = [case.sample(gen) for _ in range(16)]
        held = [case.sample(gen) for _ in range(8)]
        want = zoo.outputs(case.model, held)
        lowered = qt.quantize(case.model, calib[0], calib, backend=CPU, progress=False)
        mode(False)
        before = zoo.outputs(lowered, held)
        mode(True)
        after = zoo.outputs(lowered, held)
        same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        db = zoo.input_dependent_sqnr(want, after)
        first = held[0]
        calls = {
            "float": lambda f=case.model, a=first: f(*a),
            "before": lambda m=lowered, a=first: (mode(False), m(*a)),
            "after": lambda m=lowered, a=first: (mode(True), m(*a)),
        }
        for _ in range(args.rounds):
            cpu = {k: c for k, (_, c) in interleaved_times(calls, args.runs, warmup=3).items()}
            print(f"| {model_name} | {cpu['before'] / cpu['float']:.3f}x "
                  f"| {cpu['after'] / cpu['float']:.3f}x | {cpu['after'] / cpu['before']:.3f} "
                  f"| {db:.1f} dB{'' if same else ' (bits differ!)'} |", flush=True)  # fmt: skip
        mode(True)
        print(f"measured {model_name}", file=sys.stderr, flush=True)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, thread CPU time")


if __name__ == "__main__":
    main()
