"""Recurrent layers in ONNX Runtime: quantree's two ONNX targets against ORT's own fp32 and int8.

    python benchmarks/onnx_runtimes.py [--runs 15] [--passes 2] [--only LSTM]

Columns, each an ONNX Runtime CPU session with one thread (``intra_op_num_threads=1``):

- ``ort fp32``: ``torch.onnx.export`` of the float model;
- ``ort dynamic``: that model through ``onnxruntime.quantization.quantize_dynamic`` (int8
  weights; ORT rewrites LSTM to ``DynamicQuantizeLSTM`` and leaves GRU and RNN float);
- ``quantree qdq``: ``qt.export_onnx(ref, ...)``, the portable QDQ export;
- ``quantree ort``: ``qt.export_onnx(ref, ..., target=qt.OnnxTarget.ONNXRUNTIME)``.

Timed interleaved (each round runs every column once, the order rotating), medians of wall
and process CPU time, ratios to ``ort fp32`` of the same pass; ``--passes`` repeats the whole
measurement. SQNR (dB) of each column's output against the float model, beside quantree's
reference graph's (``ref``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from common import load_note, one_thread  # benchmarks/ is on the path
from torch import nn

import quantree as qt

COLUMNS = ["ort fp32", "ort dynamic", "quantree qdq", "quantree ort"]
ROWS = [  # (kind, input, hidden, layers, bidirectional, seq, batch)
    ("LSTM", 256, 256, 2, False, 128, 1),
    ("LSTM", 256, 256, 2, False, 128, 32),
    ("LSTM", 512, 512, 1, False, 64, 1),
    ("LSTM", 256, 256, 1, True, 128, 1),
    ("GRU", 256, 256, 2, False, 128, 1),
    ("GRU", 256, 256, 2, False, 128, 32),
    ("GRU", 512, 512, 1, False, 64, 1),
    ("GRU", 256, 256, 1, True, 128, 1),
    ("RNN", 256, 256, 2, False, 128, 1),
    ("RNN_RELU", 256, 256, 2, False, 128, 1),
]


class Output(nn.Module):
    """The layer's sequence output (what every column computes)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def _session(path: Path):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _columns(row: tuple, folder: Path) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    kind, i, h, layers, bi, seq, batch = row
    torch.manual_seed(0)
    options = {"nonlinearity": "relu"} if kind == "RNN_RELU" else {}
    layer = getattr(nn, kind.removesuffix("_RELU"))(i, h, layers, bidirectional=bi, **options)
    model = Output(layer).eval()
    x = torch.randn(seq, batch, i)
    calib = [(torch.randn(seq, batch, i),) for _ in range(4)]
    ref = qt.quantize(model, (x,), calib, progress=False)
    paths = {name: folder / f"{name.replace(' ', '_')}.onnx" for name in COLUMNS}
    torch.onnx.export(model, (x,), str(paths["ort fp32"]), input_names=["x"], dynamo=False)
    quantize_dynamic(str(paths["ort fp32"]), str(paths["ort dynamic"]), weight_type=QuantType.QInt8)
    qt.export_onnx(ref, (x,), paths["quantree qdq"])
    qt.export_onnx(ref, (x,), paths["quantree ort"], target=qt.OnnxTarget.ONNXRUNTIME)
    feed = x.numpy()
    calls: dict[str, Callable[[], object]] = {}
    sqnr: dict[str, float] = {}
    with torch.no_grad():
        want = model(x)
        sqnr["ref"] = qt.sqnr(want, ref(x))
    for name, path in paths.items():
        session = _session(path)
        feeds = {session.get_inputs()[0].name: feed}
        calls[name] = lambda s=session, f=feeds: s.run(None, f)
        sqnr[name] = qt.sqnr(want, torch.from_numpy(calls[name]()[0]))  # type: ignore[index]
    return calls, sqnr


def _times(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, tuple[float, float]]:
    names = list(calls)
    for fn in calls.values():
        for _ in range(3):
            fn()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(runs):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            calls[name]()
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
            wall[name].append((time.perf_counter() - start) * 1e3)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in names}


def _label(row: tuple) -> str:
    kind, i, h, layers, bi, seq, batch = row
    return f"{kind} {i}x{h}x{layers}{' bi' if bi else ''} T{seq} B{batch}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="timed rounds per pass")
    parser.add_argument("--passes", type=int, default=2, help="whole measurements repeated")
    parser.add_argument("--only", default="", help="rows whose label contains this (LSTM, B32)")
    opts = parser.parse_args(argv)
    one_thread()
    warnings.simplefilter("ignore")
    header = "| shape | " + " | ".join(COLUMNS) + " | SQNR dB ref / " + " / ".join(COLUMNS) + " |"
    lines = [header, "|---" * (len(COLUMNS) + 2) + "|"]
    with tempfile.TemporaryDirectory() as tmp:
        for n, row in enumerate(r for r in ROWS if opts.only in _label(r)):
            folder = Path(tmp) / str(n)
            folder.mkdir()
            calls, sqnr = _columns(row, folder)
            for p in range(opts.passes):
                times = _times(calls, opts.runs)
                wall0, cpu0 = times["ort fp32"]
                cells = [
                    f"{cpu:.2f} ms cpu ({cpu / cpu0:.2f}) / {wall:.2f} wall ({wall / wall0:.2f})"
                    for wall, cpu in (times[c] for c in COLUMNS)
                ]
                dbs = " / ".join(f"{sqnr[c]:.1f}" for c in ["ref", *COLUMNS])
                lines.append(
                    f"| {_label(row)} (pass {p + 1}) | " + " | ".join(cells) + f" | {dbs} |"
                )
            print(f"measured {_label(row)}", file=sys.stderr)
    print("\n".join(lines))
    print(f"\n{load_note()}; onnxruntime, one thread, {opts.runs} interleaved rounds per pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
