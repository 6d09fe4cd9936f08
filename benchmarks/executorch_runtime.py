"""quantree's int8 models in ExecuTorch (XNNPACK), against ExecuTorch's own flows, one thread.

    python benchmarks/executorch_runtime.py                       # cnn, resnet18 latency
    python benchmarks/executorch_runtime.py --models lstm16       # 256x2 LSTM, T16, batch 1
    python benchmarks/executorch_runtime.py --models lstm128,gru128,rnn128,bilstm128 \
        --float-lowering portable   # ExecuTorch's float baseline without XNNPACK (see below)
    python benchmarks/executorch_runtime.py --zoo                 # zoo correctness only

Latency rows (ExecuTorch's runtime, XNNPACK threadpool of one thread, interleaved rounds,
medians of wall and process CPU time): ExecuTorch float (``to_edge_transform_and_lower`` with
the XNNPACK partitioner), ExecuTorch's own int8 (``XNNPACKQuantizer`` + ``prepare_pt2e`` /
``convert_pt2e``), and quantree's reference graph through ``qt.export_executorch``'s lowering.
Columns: SQNR against float on held-out inputs (for quantree also the reference graph's own),
lowering time, latency and ratios to ExecuTorch float and to ExecuTorch's own int8, and what
XNNPACK took. ``--zoo``: every non-recurrent zoo model whose libraries are installed, exported
and run, input-dependent SQNR against float (``zoo.py``'s measure) of the reference and of
ExecuTorch. Needs executorch (docs/deployment-executorch.md says how to install it).

Recurrent models (``lstm<T>``: 256x2 LSTM, ``gru<T>``: 256x2 GRU, ``rnn<T>``: 256x2 tanh RNN,
``bilstm<T>``: 256x2 bidirectional LSTM; batch 1): quantree's layers run as its kernel
library's ``quantree_et::rnn`` op. ExecuTorch unrolls a float ``nn.LSTM`` over T, and its
XNNPACK lowering of the unrolled graph takes many minutes at T128; ``--float-lowering
portable`` lowers the float model with ``to_edge`` alone (ExecuTorch's portable kernels),
``xnnpack`` (the default) with the XNNPACK partitioner. The table says which.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cnn_mlp_latency import SmallCnn
from common import load_note, one_thread
from torch import nn

import quantree as qt
from quantree.backends.executorch import kernels, lower_executorch
from quantree.backends.executorch.export import KERNEL_OP

LATENCY_MODELS = ("cnn", "resnet18")
OWN = "et int8 (XNNPACKQuantizer)"


def _runtime() -> Any:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime

    _unsafe_reset_threadpool(1)
    return Runtime.get()


def _method(buffer: bytes) -> Callable[[tuple], list]:
    if KERNEL_OP in buffer:  # quantree's recurrent op: its kernel library, registered
        kernels.load()
    method = _runtime().load_program(buffer).load_method("forward")
    return lambda args: method.execute(list(args))


def et_float(model: nn.Module, example: tuple, lowering: str = "xnnpack") -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge, to_edge_transform_and_lower

    exported = torch.export.export(model, example)
    if lowering == "portable":
        return bytes(to_edge(exported).to_executorch().buffer)
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    return bytes(edge.to_executorch().buffer)


def et_int8(model: nn.Module, example: tuple, calib: list[tuple]) -> bytes:
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True)
    )
    prepared = prepare_pt2e(torch.export.export(model, example).module(), quantizer)
    with torch.no_grad():
        for args in calib:
            prepared(*args)
    return et_float(convert_pt2e(prepared), example)


class Lstm(nn.Module):
    """lstm_latency.py's 256x256x2 LSTM (or GRU / RNN / bidirectional), its output sequence."""

    def __init__(self, kind: type[nn.Module] = nn.LSTM, bidirectional: bool = False) -> None:
        super().__init__()
        self.lstm = kind(256, 256, 2, bidirectional=bidirectional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


RECURRENT = {"lstm": (nn.LSTM, False), "gru": (nn.GRU, False), "rnn": (nn.RNN, False)}
RECURRENT["bilstm"] = (nn.LSTM, True)


def build(name: str) -> tuple[nn.Module, Callable[[torch.Generator], tuple]]:
    kind = name.rstrip("0123456789")
    if kind in RECURRENT:
        steps = int(name.removeprefix(kind))
        module = Lstm(*RECURRENT[kind])
        return module, lambda g: (torch.randn(steps, 1, 256, generator=g),)
    if name == "cnn":
        return SmallCnn(), lambda g: (torch.randn(1, 3, 32, 32, generator=g),)
    if name == "resnet18":
        import zoo

        case = zoo.build("resnet18")
        zoo.warm_batch_norm(case.model, case, torch.Generator().manual_seed(1))
        return case.model, case.sample
    raise SystemExit(f"unknown model {name!r}")


def interleaved_process_times(
    variants: dict[str, Callable[[], object]], runs: int, warmup: int = 3
) -> dict[str, tuple[float, float]]:
    """Median wall and process-CPU milliseconds per variant, rounds interleaved, order rotating.

    Process CPU time, not thread CPU time: XNNPACK's work may run on its pool's thread, which
    the calling thread's clock does not see (one pool thread: still one core at a time)."""
    names = list(variants)
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(runs):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            variants[name]()
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
            wall[name].append((time.perf_counter() - start) * 1e3)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in names}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def cached_float(
    model: nn.Module, example: tuple, lowering: str, name: str, cache: str | None
) -> tuple[bytes, float]:
    """ExecuTorch's float program and its lowering seconds; with ``cache``, read from (or
    written to) ``cache/<name>_<lowering>.pte``: lowering an unrolled T128 float LSTM takes
    minutes, and the model is the same in every run (seeded)."""
    if cache is None:
        return timed(lambda: et_float(model, example, lowering))
    path = Path(cache) / f"{name}_{lowering}.pte"
    if path.exists():
        return path.read_bytes(), float("nan")
    program, seconds = timed(lambda: et_float(model, example, lowering))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(program)
    return program, seconds


def latency(
    name: str, runs: int, float_lowering: str = "xnnpack", cache: str | None = None
) -> None:
    torch.manual_seed(0)
    model, sample = build(name)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    calib = [sample(gen) for _ in range(16)]
    held = [sample(gen) for _ in range(4)]
    example = calib[0]
    ref = qt.quantize(
        model, example, calib, progress=False, dynamic_batch=False, backend="reference"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        programs = {"et float": cached_float(model, example, float_lowering, name, cache)}
        if name.rstrip("0123456789") not in RECURRENT:  # XNNPACKQuantizer leaves them float
            programs[OWN] = timed(lambda: et_int8(model, example, calib))
        lowered, seconds = timed(lambda: lower_executorch(ref, example))
    programs["quantree -> et"] = (lowered.buffer, seconds)
    methods = {k: _method(buf) for k, (buf, _) in programs.items()}
    with torch.no_grad():
        want = torch.cat([model(*a).flatten() for a in held])
        ref_sqnr = qt.sqnr(want, torch.cat([ref(*a).flatten() for a in held]))
    times = interleaved_process_times(
        {k: (lambda m=m: m(example)) for k, m in methods.items()}, runs
    )
    base_cpu = times["et float"][1]
    own_wall, own_cpu = times.get(OWN, (float("nan"), float("nan")))
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    threads = _threadpool_get_thread_count()
    print(f"\n## {name} ({load_note()}; et float lowered with {float_lowering}; "
          f"ExecuTorch threadpool: {threads} thread(s))\n")  # fmt: skip
    print("| variant | SQNR vs float | lowering | wall ms | CPU ms | CPU / et float "
          "| CPU / et int8 | wall / et int8 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for key, method in methods.items():
        got = torch.cat([method(a)[0].flatten() for a in held])
        sqnr = f"{qt.sqnr(want, got):.1f} dB"
        if key == "quantree -> et":
            sqnr += f" (reference {ref_sqnr:.1f})"
        wall, cpu = times[key]
        print(f"| {key} | {sqnr} | {programs[key][1]:.0f} s | {wall:.2f} | {cpu:.2f} | "
              f"{cpu / base_cpu:.2f} | {cpu / own_cpu:.2f} | {wall / own_wall:.2f} |")  # fmt: skip
    print(f"\nquantree -> et: {lowered.delegation.render()}")


def zoo_check(names: list[str]) -> None:
    import zoo

    print(f"\n## zoo through ExecuTorch ({load_note()})\n")
    print("| model | reference vs float | ExecuTorch vs float | lowering | what XNNPACK took |")
    print("|---|---|---|---|---|")
    for name in names:
        try:
            torch.manual_seed(0)
            case = zoo.build(name)
        except ImportError as err:
            print(f"| {name} | not installed: {err} | | | |")
            continue
        if case.recurrent:
            continue
        model = case.model.eval()
        gen = torch.Generator().manual_seed(0)
        zoo.warm_batch_norm(model, case, gen)
        calib = [case.sample(gen) for _ in range(16)]
        held = [case.sample(gen) for _ in range(8)]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = qt.quantize(
                    model, calib[0], calib, progress=False, dynamic_batch=False,
                    backend="reference",
                )  # fmt: skip
                start = time.perf_counter()
                lowered = lower_executorch(ref, calib[0])
                seconds = time.perf_counter() - start
            method = _method(lowered.buffer)
            want, got_ref = zoo.outputs(model, held), zoo.outputs(ref, held)
            got = [zoo.flat(method(a)) for a in held]
            print(f"| {name} | {zoo.input_dependent_sqnr(want, got_ref):.1f} dB | "
                  f"{zoo.input_dependent_sqnr(want, got):.1f} dB | {seconds:.0f} s | "
                  f"{lowered.delegation.render()} |", flush=True)  # fmt: skip
        except Exception as err:
            print(f"| {name} | fails: {zoo.one_line(err)} | | | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(LATENCY_MODELS))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--float-lowering", choices=("xnnpack", "portable"), default="xnnpack")
    parser.add_argument("--float-cache", help="directory keeping ExecuTorch's float programs")
    parser.add_argument("--zoo", action="store_true", help="zoo models: correctness only")
    parser.add_argument("--zoo-models", help="comma-separated subset of the zoo")
    args = parser.parse_args()
    one_thread()
    import executorch.kernels.quantized  # noqa: F401  (portable q/dq kernels)

    if args.zoo:
        import zoo

        zoo_check(args.zoo_models.split(",") if args.zoo_models else list(zoo.MODELS))
        return
    for name in args.models.split(","):
        latency(name, args.runs, args.float_lowering, args.float_cache)


if __name__ == "__main__":
    main()
