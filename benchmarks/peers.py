"""quantree's CPU backend against the int8 runtimes users compare with, and where its exports run.

    python benchmarks/peers.py --models cnn,resnet18 --peers quantree,et,ort_static
    python benchmarks/peers.py --models lstm_b1 --passes 2 --runs 10
    python benchmarks/peers.py --deployment --models lstm_b1,resnet18 --runtimes ort,ort_int

Over 400 lines because every peer's builder (a dozen short functions) must live in the one
process that times them interleaved; each is its runtime's documented quantization flow.

Peer mode (issue 26): per model, every peer's int8 model and the float model in one process,
one thread each, timed interleaved (each round runs every column once, the order rotating),
medians of process CPU time (XNNPACK and OpenVINO may work on a pool thread the calling
thread's clock does not see; one pool thread, so still one core), ``--passes`` whole timings.
Ratios are to float PyTorch eager of the same pass. SQNR is input-dependent (``zoo.py``: the
per-position mean over the held-out inputs removed from the signal) against float.

Peers (``--peers``): ``quantree`` (``qt.quantize`` to the CPU backend; ``quantree_h16``, not
by default: recurrent layers with int16 hidden-state feedback; ``quantree_s16``, not by
default: whole-mode int16 input and output sequences); ``et`` (ExecuTorch
XNNPACK with its own ``XNNPACKQuantizer``, per channel); ``ov`` (OpenVINO + NNCF
``nncf.quantize`` of the converted model); ``ov_qt`` (OpenVINO running quantree's QDQ
export); ``ort_dynamic`` and ``ort_static`` (ONNX Runtime's ``quantize_dynamic`` and
``quantize_static`` QDQ, per channel, of ``torch.onnx.export``); ``torchao``
(X86InductorQuantizer + ``torch.compile``, ``zoo.py``'s anchor). Float OpenVINO is compiled
with ``INFERENCE_PRECISION_HINT=f32`` (else it runs bf16 on this CPU); int8 OpenVINO models
with the runtime's defaults.

Deployment mode (issue 25, ``--deployment``): per runtime (``--runtimes``: ``et`` is
``qt.export_executorch``; ``ort`` and ``ort_int`` are ``qt.export_onnx`` with the QDQ and the
ONNXRUNTIME targets; ``ov`` is OpenVINO on the QDQ export) and model: whether it builds and
runs (else the error's first line), SQNR of its output against quantree's reference graph,
and the CPU-time ratio to that runtime's own float model, interleaved, ``--passes`` timings.
Only the public export functions are called, so what they do after a merge shows here.
A build step longer than ``--timeout`` seconds is stopped and reported (ExecuTorch's own
lowering of a float T128 LSTM takes many minutes). Each (model, runtime) runs in a child
process, so a runtime that crashes the process costs its own cell only.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from common import load_note, one_thread  # benchmarks/ is on the path
from torch import nn

import quantree as qt
from quantree.backends import CPU

Sample = Callable[[torch.Generator], tuple]
Call = Callable[[tuple], Any]

RECURRENT = ("lstm_b1", "lstm_b32", "lstm512", "deepspeech", "crnn")
ROWS = ("cnn", "resnet18", "bert", *RECURRENT)
ZOO_CNNS = ("mobilenet_v2", "squeezenet", "efficientnet_b0", "convnext_atto", "mobilevitv2_050")
ZOO_TRANSFORMERS = ("gpt2", "transformer_encoder", "vit_tiny", "conformer")
MODELS = (*ROWS, *ZOO_CNNS, *ZOO_TRANSFORMERS)
PEERS = ("quantree", "et", "ov", "ov_qt", "ort_dynamic", "ort_dynamic_rr", "ort_static", "torchao")
RUNTIMES = ("et", "ort", "ort_int", "ov")
DEPLOYMENT_MODELS = ("lstm_b1", "lstm_b32", "lstm512", "crnn", "deepspeech", "resnet18", "bert")
LSTM_SHAPES = {  # lstm_latency.py's shapes: (input, hidden, layers, seq, batch)
    "lstm_b1": (256, 256, 2, 128, 1),
    "lstm_b32": (256, 256, 2, 128, 32),
    "lstm512": (512, 512, 1, 64, 1),
}


class Timeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise :class:`Timeout` in this thread after ``seconds`` (Python-level work only)."""

    def fire(signum: int, frame: object) -> None:
        raise Timeout(f"not done after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class SequenceOutput(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def build(name: str) -> tuple[nn.Module, Sample]:
    import zoo

    if name in LSTM_SHAPES:
        i, h, layers, seq, batch = LSTM_SHAPES[name]
        model: nn.Module = SequenceOutput(nn.LSTM(i, h, layers))
        return model.eval(), lambda g: (torch.randn(seq, batch, i, generator=g),)
    if name == "cnn":
        from cnn_mlp_latency import SmallCnn

        return SmallCnn().eval(), lambda g: (torch.randn(1, 3, 32, 32, generator=g),)
    case = zoo.build(name)
    case.model.eval()
    zoo.warm_batch_norm(case.model, case, torch.Generator().manual_seed(1))
    return case.model, case.sample


def flat(out: object) -> torch.Tensor:
    if isinstance(out, list | tuple) and out and not isinstance(out[0], torch.Tensor):
        out = [torch.as_tensor(o) for o in out]  # numpy arrays from ORT / OpenVINO
    import zoo

    return zoo.flat(out)


# --- the peers: each returns a call on one argument tuple ---------------------------------


def ort_session(path: Path) -> Call:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda args: session.run(None, dict(zip(names, (a.numpy() for a in args), strict=True)))


def ov_compiled(model_or_path: Any, f32: bool) -> Call:
    import openvino as ov

    # Pinning (on by default) pins the calling thread to a core: on a shared machine every
    # later call in this process, float and the other peers included, then ran 2-3x slower.
    config = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "ENABLE_CPU_PINNING": False}
    if f32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = ov.Core().compile_model(model_or_path, "CPU", config)
    request = compiled.create_infer_request()
    return lambda args: list(request.infer([a.numpy() for a in args]).values())


def onnx_float(model: nn.Module, example: tuple, folder: Path) -> Path:
    path = folder / "float.onnx"
    if not path.exists():
        torch.onnx.export(model, example, str(path), dynamo=False)
    return path


def et_call(buffer: bytes) -> Call:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime

    from quantree.backends.executorch import export, kernels

    _unsafe_reset_threadpool(1)
    if export.KERNEL_OP in buffer:  # the program calls quantree's kernel library: register it
        kernels.load()
    program = Runtime.get().load_program(buffer)  # reads ``buffer`` in place: keep it alive
    method = program.load_method("forward")
    return lambda args, keep=(buffer, program): method.execute(list(args))


def peer_quantree(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
    return lambda args: lowered(*args)


def peer_quantree_unfused(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    """quantree with float attention blocks left as ATen calls (``cpu_backend(attention=
    False)``): the comparison's other side in the same run."""
    from quantree.backends import cpu_backend

    backend = cpu_backend(attention=False)
    lowered = qt.quantize(model, calib[0], calib, backend=backend, progress=False)
    return lambda args: lowered(*args)


def peer_quantree_aten_norms(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    """quantree with large layer norms and gelus left to ATen (the region pass's limit of the
    paths without vector rows, as before branch h-bertln): the comparison's other side."""
    import quantree.backends.cpu.passes.regions as regions

    limit = regions.float_limit
    regions.float_limit = lambda: float(regions.FLOAT_MAX_ELEMENTS)  # type: ignore[assignment]
    try:
        lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
    finally:
        regions.float_limit = limit  # type: ignore[assignment]
    return lambda args: lowered(*args)


def peer_quantree_h16(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    """quantree with recurrent layers feeding h back at int16 (``cpu_backend(hidden_bits=16)``)."""
    from quantree.backends import cpu_backend

    backend = cpu_backend(hidden_bits=16)
    lowered = qt.quantize(model, calib[0], calib, backend=backend, progress=False)
    return lambda args: lowered(*args)


def peer_quantree_s16(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    """quantree with whole-mode recurrent layers' input and output sequences at int16
    (``Int8Quantizer(recurrent_sequence_dtype=QDtype.INT16)``)."""
    quantizer = qt.Int8Quantizer(recurrent_sequence_dtype=qt.QDtype.INT16)
    lowered = qt.quantize(model, calib[0], calib, quantizer=quantizer, backend=CPU,
                          progress=False)  # fmt: skip
    return lambda args: lowered(*args)


def peer_quantree_r7(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    """quantree with 7-bit weights (``Int8Quantizer(reduce_range=True)``): on AVX2 without
    VNNI its convs and linears take the `vpmaddubsw` GEMM (csrc/isa_avx2_w7.cpp)."""
    quantizer = qt.Int8Quantizer(reduce_range=True)
    lowered = qt.quantize(model, calib[0], calib, quantizer=quantizer, backend=CPU,
                          progress=False)  # fmt: skip
    return lambda args: lowered(*args)


def peer_et(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    from executorch_runtime import et_int8

    return et_call(et_int8(model, calib[0], calib))


def peer_ov(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    import nncf
    import openvino as ov

    ov_model = ov.convert_model(model, example_input=calib[0])
    feed = [{i: a.numpy() for i, a in enumerate(args)} for args in calib]
    quantized = nncf.quantize(ov_model, nncf.Dataset(feed), subset_size=len(feed))
    return ov_compiled(quantized, f32=False)


def peer_ov_qt(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    ref = qt.quantize(model, calib[0], calib, backend=None, progress=False, dynamic_batch=False)
    path = qt.export_onnx(ref, calib[0], folder / "quantree_qdq.onnx")
    try:
        return ov_compiled(str(path), f32=False)
    except RuntimeError as error:
        # On a bf16 CPU (Sapphire Rapids: AMX) OpenVINO 2026.4's default precision finds "No
        # suitable implementations" for this QDQ graph; its int8 ops run the same under f32.
        said = [line for line in str(error).splitlines() if line.strip()] or [""]
        print(f"ov_qt: default precision failed ({said[-1][:90]}); f32 hint")
        return ov_compiled(str(path), f32=True)


def peer_ort_dynamic(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = folder / "ort_dynamic.onnx"
    quantize_dynamic(
        str(onnx_float(model, calib[0], folder)), str(out), weight_type=QuantType.QInt8
    )
    return ort_session(out)


def peer_ort_dynamic_rr(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    """ORT's dynamic int8 with 7-bit weights (``reduce_range``). On x86 CPUs without VNNI
    (AVX2 only) MLAS multiplies u8 x s8 with ``vpmaddubsw``, whose int16 pair sums saturate
    at full-range weights: there the plain ``ort_dynamic`` row loses 20 dB (12.5 against
    33.9 dB on the 256x2 LSTM, Zen 3, benchmarks/README.md), and ORT's documentation asks
    for ``reduce_range`` on such CPUs. Both rows are kept so that each machine shows both."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = folder / "ort_dynamic_rr.onnx"
    quantize_dynamic(
        str(onnx_float(model, calib[0], folder)),
        str(out),
        weight_type=QuantType.QInt8,
        reduce_range=True,
    )
    return ort_session(out)


def peer_ort_static(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    src = onnx_float(model, calib[0], folder)
    names = [i.name for i in ort.InferenceSession(str(src)).get_inputs()]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([dict(zip(names, (a.numpy() for a in args), strict=True))
                               for args in calib])  # fmt: skip

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    out = folder / "ort_static.onnx"
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    return ort_session(out)


def peer_torchao(model: nn.Module, calib: list[tuple], folder: Path) -> Call:
    import zoo

    compiled = zoo.torchao_variant(zoo.Case(model, lambda g: calib[0]), calib)[0]
    return lambda args: compiled(*args)


PEER_BUILDERS: dict[str, Callable[[nn.Module, list[tuple], Path], Call]] = {
    "quantree": peer_quantree,
    "quantree_unfused": peer_quantree_unfused,
    "quantree_aten_norms": peer_quantree_aten_norms,
    "quantree_h16": peer_quantree_h16,
    "quantree_s16": peer_quantree_s16,
    "quantree_r7": peer_quantree_r7,
    "et": peer_et,
    "ov": peer_ov,
    "ov_qt": peer_ov_qt,
    "ort_dynamic_rr": peer_ort_dynamic_rr,
    "ort_dynamic": peer_ort_dynamic,
    "ort_static": peer_ort_static,
    "torchao": peer_torchao,
}


# --- timing -------------------------------------------------------------------------------


def cpu_medians(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median process-CPU milliseconds per call, interleaved rounds, the order rotating."""
    names = list(calls)
    with torch.inference_mode():
        for fn in calls.values():
            for _ in range(2):
                fn()
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(runs):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.process_time()
                calls[name]()
                cpu[name].append((time.process_time() - start) * 1e3)
    return {n: statistics.median(cpu[n]) for n in names}


def one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text.replace("|", "/")[:140]


def data(model_name: str) -> tuple[nn.Module, list[tuple], list[tuple]]:
    torch.manual_seed(0)
    model, sample = build(model_name)
    gen = torch.Generator().manual_seed(0)
    return model, [sample(gen) for _ in range(16)], [sample(gen) for _ in range(4)]


def sqnr(want: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    import zoo

    return zoo.input_dependent_sqnr(want, got)


def measure_peers(name: str, peers: list[str], args: argparse.Namespace) -> list[str]:
    import zoo

    model, calib, held = data(name)
    want = zoo.outputs(model, held)
    calls: dict[str, Call] = {"float": lambda a: model(*a)}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for peer in peers:
            if peer == "et" and name in RECURRENT:
                notes[peer] = (
                    "skipped: XNNPACKQuantizer leaves the LSTM float; lowering T128 takes minutes"
                )
                continue
            try:
                with warnings.catch_warnings(), deadline(args.timeout):
                    warnings.simplefilter("ignore")
                    call = PEER_BUILDERS[peer](model, calib, Path(tmp))
                    with torch.no_grad():
                        got = [flat(call(a)) for a in held]
                notes[peer] = f"{sqnr(want, got):.1f} dB"
                calls[peer] = call
            except Exception as err:  # a peer that cannot build this model is a result
                notes[peer] = f"fails: {one_line(err)}"
        print(f"built {name}: {notes}", file=sys.stderr, flush=True)
        lines = []
        for p in range(args.passes):
            ms = cpu_medians({k: (lambda c=c: c(held[0])) for k, c in calls.items()}, args.runs)
            cells = []
            for peer in peers:
                if peer in ms:
                    cells.append(f"{ms[peer] / ms['float']:.2f}x, {notes[peer]}")
                else:
                    cells.append(notes.get(peer, "-"))
            lines.append(
                f"| {name} (pass {p + 1}) | {ms['float']:.2f} | " + " | ".join(cells) + " |"
            )
    return lines


# --- deployment ---------------------------------------------------------------------------


def deployment_pair(runtime: str, model: nn.Module, ref: nn.Module, example: tuple,
                    folder: Path) -> tuple[Call, Call]:  # fmt: skip
    """(the runtime's float model, quantree's int8 model in that runtime)."""
    if runtime == "et":
        from executorch_runtime import et_float

        path = qt.export_executorch(ref, example, folder / "quantree.pte")
        return et_call(et_float(model, example)), et_call(path.read_bytes())
    if runtime in ("ort", "ort_int"):
        target = qt.OnnxTarget.QDQ if runtime == "ort" else qt.OnnxTarget.ONNXRUNTIME
        path = qt.export_onnx(ref, example, folder / f"{runtime}.onnx", target=target)
        return ort_session(onnx_float(model, example, folder)), ort_session(path)
    if runtime == "ov":
        import openvino as ov

        path = qt.export_onnx(ref, example, folder / "ov_qdq.onnx")
        float_model = ov.convert_model(model, example_input=example)
        return ov_compiled(float_model, f32=True), ov_compiled(str(path), f32=False)
    raise SystemExit(f"unknown runtime {runtime!r}; choose from {', '.join(RUNTIMES)}")


def measure_deployment(name: str, runtimes: list[str], args: argparse.Namespace) -> list[str]:
    model, calib, held = data(name)
    ref = qt.quantize(model, calib[0], calib, backend=None, progress=False, dynamic_batch=False)
    with torch.no_grad():
        want = [flat(ref(*a)) for a in held]
    lines = []
    for runtime in runtimes:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with warnings.catch_warnings(), deadline(args.timeout):
                    warnings.simplefilter("ignore")
                    float_call, int8_call = deployment_pair(runtime, model, ref, held[0], Path(tmp))
                    got = [flat(int8_call(a)) for a in held]
            except Exception as err:
                lines.append(f"| {name} | {runtime} | fails: {one_line(err)} | | |")
                print(lines[-1], file=sys.stderr, flush=True)
                continue
            db = qt.sqnr(torch.cat(want), torch.cat(got))
            ratios = []
            for _ in range(args.passes):
                ms = cpu_medians(
                    {
                        "float": lambda f=float_call: f(held[0]),
                        "int8": lambda q=int8_call: q(held[0]),
                    },
                    args.runs,
                )
                ratios.append(
                    f"{ms['int8'] / ms['float']:.2f}x ({ms['int8']:.2f} / {ms['float']:.2f} ms)"
                )
            lines.append(f"| {name} | {runtime} | runs | {db:.1f} dB | {'; '.join(ratios)} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def deployment_child(name: str, runtime: str, args: argparse.Namespace) -> list[str]:
    """One (model, runtime) cell in a process of its own: a runtime that crashes the process
    (a segfault, memory) costs its cell, not the table."""
    import subprocess

    cmd = [sys.executable, __file__, "--deployment", "--child", "--models", name,
           "--runtimes", runtime, "--runs", str(args.runs), "--passes", str(args.passes),
           "--timeout", str(args.timeout)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith(f"| {name} |")]
    if done.returncode != 0 or not rows:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:120].replace("|", "/")
        rows = [f"| {name} | {runtime} | crashed (exit {done.returncode}): {tail} | | |"]
    print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--deployment", action="store_true", help="issue 25's deployment table")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--runs", type=int, default=10, help="timed rounds per pass")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per build step")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    one_thread()
    import executorch.kernels.quantized  # noqa: F401  (portable q/dq kernels)

    warnings.filterwarnings("ignore", category=UserWarning)
    default = DEPLOYMENT_MODELS if args.deployment else MODELS
    names = args.models.split(",") if args.models else list(default)
    print(f"{load_note()}; torch {torch.__version__}; one thread, {args.runs} rounds x "
          f"{args.passes} passes, process CPU time", file=sys.stderr)  # fmt: skip
    if args.deployment:
        lines = ["| model | runtime | builds and runs | SQNR vs quantree's reference "
                 "| CPU-time ratio to the runtime's float |", "|---|---|---|---|---|"]  # fmt: skip
        for name in names:
            if args.child:
                lines += measure_deployment(name, args.runtimes.split(","), args)
                continue
            for runtime in args.runtimes.split(","):
                lines += deployment_child(name, runtime, args)
    else:
        peers = args.peers.split(",")
        lines = ["| model | float eager ms | " + " | ".join(peers) + " |",
                 "|---" * (len(peers) + 2) + "|"]  # fmt: skip
        for name in names:
            lines += measure_peers(name, peers, args)
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    print(f"\n{load_note()}; torch {torch.__version__}; one thread; CPU-time ratios")
    return 0


if __name__ == "__main__":
    sys.exit(main())
