"""Issue 25's deployment lines on three models no other benchmark uses, one thread.

    python benchmarks/onnx_outside.py [--models kws_gru,crnn_bilstm,tiny_encoder]
        [--runtimes ort,ort_int,ov,et] [--runs 20]

Models (random weights, batch norm warmed, batch 1, static shapes): ``kws_gru`` (keyword
spotting: a 1-d conv over 49 MFCC frames, a 2-layer batch-first GRU of 128, the last step),
``crnn_bilstm`` (text-line recognizer: conv/batch-norm/pool front, a 2-layer bidirectional
LSTM of 128 over the columns, CTC logits), ``tiny_encoder`` (pre-norm transformer encoder,
hand-written attention with ``scaled_dot_product_attention``, mean pooling).

Runtimes: ``ort`` (ONNX Runtime on ``qt.export_onnx``'s QDQ export), ``ort_int`` (the
``OnnxTarget.ONNXRUNTIME`` export), ``ov`` (OpenVINO compiling the QDQ export, f32 hint),
``et`` (``qt.export_executorch``'s lowering, ExecuTorch's runtime). Per cell: builds and runs or
the error, SQNR against quantree's reference graph and against float on 4 held-out inputs, the
CPU-time ratio against that runtime's own float model (``torch.onnx.export`` of the float
model; two interleaved passes; not for ``et``, whose float lowering of a recurrent model
unrolls it), what the recurrent layers became, and quantree's warnings (what runs float).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import load_note, one_thread  # benchmarks/ is on the path
from torch import nn

import quantree as qt


class KwsGru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(40, 64, 3, padding=1)
        self.gru = nn.GRU(64, 128, 2, batch_first=True)
        self.fc = nn.Linear(128, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 40]
        y = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.fc(self.gru(y)[0][:, -1])


class CrnnBiLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d((2, 1)),
        )  # fmt: skip
        self.rnn = nn.LSTM(64 * 8, 128, 2, bidirectional=True)
        self.head = nn.Linear(256, 37)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, 32, W]
        f = self.front(x)
        b, c, h, w = f.shape
        return self.head(self.rnn(f.reshape(b, c * h, w).permute(2, 0, 1))[0])


class Block(nn.Module):
    def __init__(self, d: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        self.pos = nn.Parameter(torch.randn(1, 32, 128) * 0.02)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln = nn.LayerNorm(128)
        self.cls = nn.Linear(128, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, 32]
        return self.cls(self.ln(self.blocks(self.emb(ids) + self.pos)).mean(1))


Sample = Callable[[torch.Generator], tuple]
MODELS: dict[str, tuple[type[nn.Module], Sample]] = {
    "kws_gru": (KwsGru, lambda g: (torch.randn(1, 49, 40, generator=g),)),
    "crnn_bilstm": (CrnnBiLstm, lambda g: (torch.randn(1, 1, 32, 100, generator=g),)),
    "tiny_encoder": (TinyEncoder, lambda g: (torch.randint(0, 1000, (1, 32), generator=g),)),
}
RECURRENT_OPS = {"LSTM", "GRU", "RNN", "DynamicQuantizeLSTM", "Scan"}


def cpu_ms(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median process-CPU milliseconds per call, rounds interleaved, the order rotating."""
    for fn in calls.values():
        fn()
    names = list(calls)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            start = time.process_time()
            calls[n]()
            cpu[n].append((time.process_time() - start) * 1e3)
    return {n: statistics.median(v) for n, v in cpu.items()}


def _ort(path: Path) -> Callable[[tuple], torch.Tensor]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda a: torch.from_numpy(
        session.run(None, {n: t.numpy() for n, t in zip(names, a, strict=True)})[0]
    )


def _ov(path: Path) -> Callable[[tuple], torch.Tensor]:
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    return lambda a: torch.from_numpy(compiled([t.numpy() for t in a])[0])


def _et(ref: torch.fx.GraphModule, example: tuple) -> tuple[Callable, str]:
    import executorch.kernels.quantized  # noqa: F401  (portable q/dq kernels)
    from executorch.runtime import Runtime

    from quantree.backends.executorch import kernels, lower_executorch
    from quantree.backends.executorch.export import KERNEL_OP

    lowered = lower_executorch(ref, example)
    if KERNEL_OP in lowered.buffer:
        kernels.load()
    # the runtime reads the program from these bytes without copying them: the runner keeps
    # them (and the program) alive, or a later call reads freed memory
    program = Runtime.get().load_program(lowered.buffer)
    method = program.load_method("forward")
    keep = (lowered, program)
    return lambda a, _keep=keep: method.execute(list(a))[0], lowered.delegation.render()


def cell(name: str, runtime: str, model: nn.Module, ref, example, folder: Path):  # type: ignore[no-untyped-def]
    """The quantized model's runner in ``runtime``, what became of it, the float runner."""
    import onnx

    if runtime == "et":
        run, how = _et(ref, example)
        return run, how, None
    target = qt.OnnxTarget.ONNXRUNTIME if runtime == "ort_int" else qt.OnnxTarget.QDQ
    path = qt.export_onnx(ref, example, folder / f"{name}_{runtime}.onnx", target=target)
    float_path = folder / f"{name}_float.onnx"
    if not float_path.exists():
        torch.onnx.export(model, example, str(float_path), dynamo=False)
    ops = sorted({n.op_type for n in onnx.load(str(path)).graph.node} & RECURRENT_OPS)
    how = "recurrent: " + (", ".join(ops) or "none")
    load = _ov if runtime == "ov" else _ort
    return load(path), how, load(float_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--runtimes", default="ort,ort_int,ov,et")
    parser.add_argument("--runs", type=int, default=20)
    opts = parser.parse_args()
    one_thread()
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    print(f"\n({load_note()} at the start)\n")
    print("| model | runtime | runs | SQNR vs reference / vs float | CPU-time ratio to the "
          "runtime's float (two passes) | what became of it | quantree's warnings |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    folder = Path(tempfile.mkdtemp())
    for name in opts.models.split(","):
        kind, sample = MODELS[name]
        torch.manual_seed(0)
        model = kind()
        gen = torch.Generator().manual_seed(0)
        model.train()
        with torch.no_grad():  # batch norm statistics from a few inputs
            for _ in range(8):
                model(*sample(gen))
        model.eval()
        calib = [sample(gen) for _ in range(16)]
        held = [sample(gen) for _ in range(4)]
        example = calib[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = qt.quantize(
                model, example, calib, progress=False, dynamic_batch=False, backend="reference"
            )
        with torch.no_grad():
            want = torch.cat([model(*a).flatten() for a in held])
            ref_out = torch.cat([ref(*a).flatten() for a in held])
        ref_db = qt.sqnr(want, ref_out)
        for runtime in opts.runtimes.split(","):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start = time.perf_counter()
                try:
                    run, how, float_run = cell(name, runtime, model, ref, example, folder)
                except Exception as err:
                    print(f"| {name} | {runtime} | fails: {type(err).__name__}: "
                          f"{str(err).splitlines()[0][:300]} | | | | |", flush=True)  # fmt: skip
                    continue
            seconds = time.perf_counter() - start
            said = "; ".join(
                str(w.message)[:160] for w in caught if issubclass(w.category, qt.QuantreeWarning)
            )
            got = torch.cat([run(a).flatten() for a in held])
            timing = ""
            if float_run is not None:
                calls = {
                    "int": lambda r=run, a=example: r(a),
                    "float": lambda f=float_run, a=example: f(a),
                }
                passes = [cpu_ms(calls, opts.runs) for _ in range(2)]
                timing = "; ".join(
                    f"{t['int'] / t['float']:.2f}x ({t['int']:.2f} / {t['float']:.2f} ms)"
                    for t in passes
                )
            print(f"| {name} | {runtime} | yes ({seconds:.0f} s to export and load) | "
                  f"{qt.sqnr(ref_out, got):.1f} / {qt.sqnr(want, got):.1f} dB (reference "
                  f"{ref_db:.1f}) | {timing} | {how} | {said or 'none'} |", flush=True)  # fmt: skip
    print(f"\n({load_note()} at the end)")


if __name__ == "__main__":
    main()
