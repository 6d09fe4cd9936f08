"""ONNX Runtime on quantree's QDQ ONNX export beside quantree's CPU backend, one thread.

    python benchmarks/onnx_runtime.py [--runs 20]

Models: the bundled char-LM (LSTM, whole mode; batch 1 x 64 characters) and a small CNN
(batch 1, 3x32x32). Columns: float PyTorch; quantree lowered to ``quantree.backends.CPU``;
ONNX Runtime (all graph optimizations, one thread) on ``qt.export_onnx`` of the reference graph.
Ratios are to float measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from cnn_mlp_latency import SmallCnn  # benchmarks/ is on the path
from common import interleaved_medians, load_note, one_thread, table

import quantree as qt
from quantree.backends import CPU
from quantree.backends.onnx import onnx_session
from quantree.workloads import batches, load_charlm, load_corpus

COLUMNS = ["float", "quantree cpu", "onnxruntime qdq"]


def _variants(model, calib, tmp: Path, name: str) -> dict[str, object]:
    args = calib[0]
    ref = qt.quantize(model, args, calib, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    path = qt.export_onnx(ref, args, tmp / f"{name}.onnx")
    session = onnx_session(path, threads=1)
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
    return {
        "float": lambda: model(*args),
        "quantree cpu": lambda: low(*args),
        "onnxruntime qdq": lambda: session.run(None, feeds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    opts = parser.parse_args(argv)
    one_thread()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_charlm("lstm")
        text = load_corpus("train", max_chars=100_000)
        lm_calib = batches(text, batch_size=1, seq_len=64, n_batches=8, seed=0)
        variants = _variants(lm, lm_calib, Path(tmp), "charlm")
        rows.append(("char-LM LSTM 1x64", interleaved_medians(variants, opts.runs)))  # type: ignore[arg-type]
        cnn = SmallCnn().eval()
        cnn_calib = [(torch.randn(1, 3, 32, 32),) for _ in range(8)]
        variants = _variants(cnn, cnn_calib, Path(tmp), "cnn")
        rows.append(("small CNN 1x3x32x32", interleaved_medians(variants, opts.runs)))  # type: ignore[arg-type]
    print(table("model", COLUMNS, rows))  # type: ignore[arg-type]
    print(load_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
