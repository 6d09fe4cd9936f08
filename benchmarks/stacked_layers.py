"""Stacked recurrent layers split per layer at prepare, against the stacked call kept whole.

    python benchmarks/stacked_layers.py [--runs 10]

For each model: the lowered model's SQNR against float on 4 held-out batches, and its
thread-CPU median time as a ratio to float, interleaved in the same rounds, with
``Int8Quantizer()`` (each layer's output observed, int8 between layers) and
``Int8Quantizer(split_layers=False)`` (the CPU backend carries the inner layers at int16).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import load_note, one_thread  # benchmarks/ is on the path
from torch import nn

import quantree as qt
from quantree.backends import CPU

MODELS = {  # (layer, input size, seq, batch)
    "LSTM 256x256 x2, T128, batch 32": (lambda: nn.LSTM(256, 256, 2), 256, 128, 32),
    "LSTM 256x256 x2, T128, batch 1": (lambda: nn.LSTM(256, 256, 2), 256, 128, 1),
    "GRU 256x256 x2 bidirectional, T128, batch 8": (
        lambda: nn.GRU(256, 256, 2, bidirectional=True), 256, 128, 8,
    ),
    "LSTM 128x128 x3 bidirectional, T50, batch 4": (
        lambda: nn.LSTM(128, 128, 3, bidirectional=True), 128, 50, 4,
    ),
    "RNN tanh 64x64 x2, T40, batch 2": (lambda: nn.RNN(64, 64, 2), 64, 40, 2),
}  # fmt: skip


class Output(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def measure(label: str, factory, size: int, seq: int, batch: int, runs: int) -> str:
    torch.manual_seed(0)
    model = Output(factory().eval()).eval()
    x = torch.randn(seq, batch, size)
    calib = [(torch.randn(seq, batch, size),) for _ in range(4)]
    held = [torch.randn(seq, batch, size) for _ in range(4)]
    variants = {"float": model}
    for name, quantizer in (
        ("whole stacked", qt.Int8Quantizer(split_layers=False)),
        ("split per layer", qt.Int8Quantizer()),
    ):
        prepared = qt.prepare(qt.capture(model, (x,)), quantizer)
        qt.calibrate(prepared, calib, progress=False)
        variants[name] = qt.lower(qt.convert(prepared), CPU)
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        want = torch.cat([model(h) for h in held])
        sqnr = {n: qt.sqnr(want, torch.cat([m(h) for h in held])) for n, m in variants.items()}
        for m in variants.values():
            m(x)
        for _ in range(runs):
            for name, m in variants.items():
                start = time.thread_time()
                m(x)
                times[name].append(time.thread_time() - start)
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    cells = [
        f"{median[n] / median['float']:.3f}x / {sqnr[n]:.1f} dB"
        for n in ("whole stacked", "split per layer")
    ]
    return f"| {label} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed rounds (median of these)")
    args = parser.parse_args()
    one_thread()
    print("| model | whole stacked: CPU-time ratio to float / SQNR | split per layer |")
    print("| --- | --- | --- |")
    for label, (factory, size, seq, batch) in MODELS.items():
        print(measure(label, factory, size, seq, batch, args.runs), flush=True)
    print(f"\n{load_note()}; torch {torch.__version__}; {args.runs} interleaved rounds")


if __name__ == "__main__":
    main()
