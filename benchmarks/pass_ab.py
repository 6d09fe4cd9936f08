"""A lowering pass's effect on the zoo: the CPU backend with and without it, same process.

    python benchmarks/pass_ab.py --passes drop_eval_dropout --models bert,gpt2 --runs 10

Per model (``zoo.py``'s builders, data and input-dependent SQNR against float): the model
lowered to the CPU backend as it is ("after") and with the named ``backend.py`` passes
replaced by a no-op ("before"; ``--torch-guards``: its shape guard also run as torch.export's
on every call), both from the same reference graph, timed interleaved with
float (medians of thread CPU time, ``--rounds`` whole timings). The "zoo table before and
after, same run" of a lowering change: the two columns differ by that change alone.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings

import torch
import zoo
from common import interleaved_times, load_note, one_thread

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend
from quantree.core.capturing.shape_guards import PassedShapes


def lowered_without(ref: torch.fx.GraphModule, names: list[str]) -> torch.fx.GraphModule:
    saved = {name: getattr(cpu_backend, name) for name in names}
    try:
        for name in names:
            setattr(cpu_backend, name, lambda gm, *a, **k: 0)
        return qt.lower(ref, CPU)
    finally:
        for name, fn in saved.items():
            setattr(cpu_backend, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", required=True, help="backend.py names, comma-separated")
    parser.add_argument("--models", default="bert,gpt2,transformer_encoder,vit_tiny,resnet18")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--torch-guards", action="store_true", help="before: torch.export's shape guard per call"
    )
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    names = args.passes.split(",")
    print("| model | before: CPU ratio, SQNR | after: CPU ratio, SQNR | after / before |")
    print("|---|---|---|---|")
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        case = zoo.build(model_name)
        case.model.eval()
        zoo.warm_batch_norm(case.model, case, gen)
        calib = [case.sample(gen) for _ in range(16)]
        held = [case.sample(gen) for _ in range(8)]
        want = zoo.outputs(case.model, held)
        ref = qt.quantize(case.model, calib[0], calib, backend=None, progress=False)
        models = {"before": lowered_without(ref, names), "after": qt.lower(ref, CPU)}
        guard = getattr(models["before"], "_guards_fn", None)
        if args.torch_guards and isinstance(guard, PassedShapes):  # shared with "after": a copy
            models["before"]._guards_fn = copy.deepcopy(guard)
            models["before"]._guards_fn.__class__ = torch.nn.Module  # torch's guard every call
        db = {k: zoo.input_dependent_sqnr(want, zoo.outputs(m, held)) for k, m in models.items()}
        first = held[0]
        calls = {"float": lambda f=case.model, a=first: f(*a)}
        calls.update({k: (lambda m=m, a=first: m(*a)) for k, m in models.items()})
        for _ in range(args.rounds):
            cpu = {k: c for k, (_, c) in interleaved_times(calls, args.runs, warmup=3).items()}
            print(f"| {model_name} | {cpu['before'] / cpu['float']:.3f}x, {db['before']:.1f} dB "
                  f"| {cpu['after'] / cpu['float']:.3f}x, {db['after']:.1f} dB "
                  f"| {cpu['after'] / cpu['before']:.3f} |", flush=True)  # fmt: skip
        print(f"measured {model_name}", file=sys.stderr, flush=True)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, thread CPU time")


if __name__ == "__main__":
    main()
