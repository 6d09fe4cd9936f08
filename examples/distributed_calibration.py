"""Calibrate the bundled char-LM on several processes.

    torchrun --nproc-per-node 2 examples/distributed_calibration.py
    torchrun --nproc-per-node 2 examples/distributed_calibration.py --mode cells --batches 8
    python examples/distributed_calibration.py            # the same on one process

Every process captures and prepares the same model, builds the same list of calibration
batches and calibrates on its own contiguous block of it (``qt.shard``). Inside the process
group ``torchrun`` starts, ``qt.calibrate`` merges every observer's statistics at the end, so
each process then holds what one process calibrating on all the batches would: rank 0
converts and reports. ``--check`` also calibrates on all the batches in rank 0 alone and
compares every observer's parameters with the merged ones.

Rank 0 prints one JSON line: processes, threads, batches, the calibration time (from a
barrier before the first batch to the end of the merge, the slowest rank's), the merge's
share of it, each rank's CPU time over the same span (on a shared machine wall time
depends on how many cores the others leave; CPU time does not), and bits per character of
the quantized model on validation text.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import quantree as qt
from quantree.core.observing.distributed import observers
from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus

BATCH, SEQ = 16, 128


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("whole", "cells"), default="whole")
    parser.add_argument("--observer", choices=[k.value for k in qt.ObserverKind], default="minmax")
    parser.add_argument("--batches", type=int, default=48, help="calibration batches in all")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--eval-chars", type=int, default=20_000, help="0: no bits/char")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    return parser.parse_args()


def _prepared(quantizer: qt.Quantizer, example: tuple[torch.Tensor]) -> torch.fx.GraphModule:
    return qt.prepare(qt.capture(load_charlm("lstm"), example), quantizer)


def _parameters(prepared: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (o.qparams().scale, o.qparams().zero_point) for name, o in observers(prepared)}


def _differences(merged: torch.nn.Module, single: torch.nn.Module) -> list[str]:
    mine, theirs = _parameters(merged), _parameters(single)
    return [
        name
        for name, (scale, zero_point) in theirs.items()
        if not (torch.equal(mine[name][0], scale) and torch.equal(mine[name][1], zero_point))
    ]


def main() -> None:
    args = _arguments()
    torch.set_num_threads(args.threads)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")  # torchrun's environment says where the others are
    rank = dist.get_rank() if dist.is_initialized() else 0
    processes = dist.get_world_size() if dist.is_initialized() else 1

    data = batches(load_corpus("train"), BATCH, SEQ, args.batches, seed=0)
    quantizer = qt.Int8Quantizer(
        recurrent=qt.RecurrentMode(args.mode), activation_observer=qt.ObserverKind(args.observer)
    )
    prepared = _prepared(quantizer, data[0])

    if dist.is_initialized():
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    qt.calibrate(prepared, qt.shard(data), progress=False, merge=False)
    fed = time.perf_counter()
    qt.merge_statistics(prepared)  # what qt.calibrate does by itself when merge=True
    done, cpu = time.perf_counter(), time.process_time() - cpu
    cpus = [cpu] * processes
    if dist.is_initialized():
        dist.all_gather_object(cpus, cpu)

    if rank == 0:
        report: dict[str, object] = {
            "processes": processes,
            "threads": args.threads,
            "mode": args.mode,
            "observer": args.observer,
            "batches": args.batches,
            "calibrate_s": round(done - start, 3),
            "merge_s": round(done - fed, 3),
            "cpu_s_per_rank": [round(c, 3) for c in cpus],
        }
        if args.check:
            single = _prepared(quantizer, data[0])
            qt.calibrate(single, data, progress=False, merge=False)  # rank 0 alone, all of it
            report["parameters_differing_from_one_process"] = _differences(prepared, single)
        if args.eval_chars:
            reference = qt.convert(prepared)
            stream = load_corpus("validation", max_chars=args.eval_chars)
            report["bits_per_char"] = round(bits_per_char(reference, stream, SEQ, BATCH), 4)
        print(json.dumps(report), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
