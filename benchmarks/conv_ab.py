"""Convolutions of another quantree tree against this one's, per shape and per CNN, one process.

    git archive main | tar -x -C /tmp/base_cnn
    python benchmarks/conv_ab.py --base /tmp/base_cnn/src --runs 15 \\
        --models cnn,resnet18,mobilenet_v2,squeezenet,efficientnet_b0

A kernel change to the convolutions shows per shape first (a conv + relu alone, at resnet18's
and the small CNN's shapes, batch 1, channels-last as the lowered graph keeps it), then in
the zoo's CNNs (``peers.build``). Both trees lower the same float model from the same
calibration; their outputs are compared bit for bit (a kernel change must not move a code)
and both run interleaved with float (``common.interleaved_times``: thread CPU time).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from against_tree import renamed_copy
from common import interleaved_times, load_note, one_thread
from onednn_kernels import CONVS
from torch import nn

import quantree as qt
from quantree.backends import CPU


def conv_case(cin: int, cout: int, size: int, k: int, s: int) -> tuple[nn.Module, tuple]:
    model = nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2), nn.ReLU()).eval()
    return model, (torch.randn(1, cin, size, size),)


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the other tree's src directory")
    parser.add_argument("--models", default="cnn,resnet18,mobilenet_v2,squeezenet")
    parser.add_argument("--no-shapes", action="store_true", help="the models only")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--reduce-range", action="store_true", help="both trees with 7-bit weights")
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    cases: list[tuple[str, nn.Module, list[tuple]]] = []
    gen = torch.Generator().manual_seed(0)
    if not args.no_shapes:
        for cin, cout, size, k, s in CONVS:
            model, x = conv_case(cin, cout, size, k, s)
            calib = [x] + [(torch.randn(x[0].shape, generator=gen),) for _ in range(3)]
            cases.append((f"conv {cin}->{cout}, {size}x{size}, k{k} s{s}", model, calib))
    for name in args.models.split(",") if args.models else []:
        model, sample = peers.build(name)
        cases.append((name, model, [sample(gen) for _ in range(4)]))
    with tempfile.TemporaryDirectory() as tmp:
        renamed_copy(Path(args.base), Path(tmp))
        sys.path.insert(0, tmp)
        qtbase = importlib.import_module("qtbase")
        base_cpu = importlib.import_module("qtbase.backends").CPU
        print("| case | float ms (CPU) | base | this tree | this / base | bits equal |")
        print("|---|---|---|---|---|---|")
        for label, model, calib in cases:
            kw = {"progress": False, "dynamic_batch": False}
            rr = {"reduce_range": True} if args.reduce_range else {}
            base = qtbase.quantize(model, calib[0], calib, backend=base_cpu,
                                   quantizer=qtbase.Int8Quantizer(**rr), **kw)  # fmt: skip
            new = qt.quantize(model, calib[0], calib, backend=CPU,
                              quantizer=qt.Int8Quantizer(**rr), **kw)  # fmt: skip
            x = calib[0]
            with torch.inference_mode():
                equal = torch.equal(base(*x), new(*x))
            times = interleaved_times(
                {
                    k: lambda m=m, x=x: m(*x)
                    for k, m in (("float", model), ("base", base), ("new", new))
                },
                args.runs,
                warmup=3,
            )
            fc, bc, nc = (times[k][1] for k in ("float", "base", "new"))
            print(f"| {label} | {fc:.3f} | {bc / fc:.3f}x | {nc / fc:.3f}x | {nc / bc:.3f} "
                  f"| {equal} |", flush=True)  # fmt: skip
    print(f"\n{load_note()}; torch {torch.__version__}, one thread, thread CPU time")


if __name__ == "__main__":
    main()
