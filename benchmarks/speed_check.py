"""The CPU backend's speed estimate against a measurement, per zoo model.

    cd benchmarks && PYTHONPATH=../src:. python speed_check.py --models xlstm,resnet18 --runs 10

For each model: ``qt.quantize`` with the default backend, the estimate it kept
(``quantree.backends.cpu.speed_of``), whether it warned, and the measured ratio of the
lowered model to float eager (process CPU time, one thread, interleaved rounds in this
process), so the estimate's threshold can be checked against what it predicts.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import modern_zoo
import torch
import zoo
from common import one_thread

import quantree as qt
from quantree.backends.cpu import speed_of


def build(name: str) -> zoo.Case:
    return modern_zoo.build(name) if name in modern_zoo.MODELS else zoo.build(name)


def measure(name: str, runs: int) -> str:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    case = build(name)
    case.model.eval()
    calib = [case.sample(gen) for _ in range(8)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", qt.QuantreeWarning)
        start = time.process_time()
        lowered = qt.quantize(case.model, calib[0], calib, progress=False)
        quantize_s = time.process_time() - start
    warned = any("no faster than the float" in str(w.message) for w in said)
    estimate = speed_of(lowered)
    x = calib[0]
    times: dict[str, list[float]] = {"float": [], "lowered": []}
    with torch.no_grad():
        for _ in range(3):
            case.model(*x)
            lowered(*x)
        for _ in range(runs):
            for label, f in (("float", case.model), ("lowered", lowered)):
                start = time.process_time()
                f(*x)
                times[label].append(time.process_time() - start)
    ratio = statistics.median(times["lowered"]) / statistics.median(times["float"])
    est = f"{estimate.ratio:.2f}x" if estimate else "none"
    return (
        f"| {name} | {est} | {'yes' if warned else 'no'} | {ratio:.2f}x "
        f"| {1e3 * statistics.median(times['float']):.2f} | {quantize_s:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="xlstm,recurrent_gemma,resnet18")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore", category=UserWarning)
    print("| model | estimate | warned | measured CPU-time ratio | float ms | quantize s |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        try:
            print(measure(name, args.runs), flush=True)
        except Exception as err:  # a model this environment cannot build or quantize
            print(f"| {name} | fails: {zoo.one_line(err)} | | | | |", flush=True)


if __name__ == "__main__":
    main()
