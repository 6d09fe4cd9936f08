"""What a quantize costs, step by step, against the float forward passes of the same batches.

    python benchmarks/quantize_time.py  # resnet18, speech, charlm; 1 and default threads
    python benchmarks/quantize_time.py --models speech --threads 1 --batches 8
    python benchmarks/quantize_time.py --profile resnet18  # cProfile of one quantize, top 30

Each model is quantized with the public steps (capture, prepare, calibrate, convert, lower to
the CPU backend, save) on the same calibration batches; ``float`` is the float model run on
those batches under ``torch.no_grad``. Times are wall-clock seconds with process CPU seconds
beside them; ``calibrate/float`` and ``all but calibrate`` are in CPU time, which other jobs
on a shared machine do not inflate. resnet18 is defined here
from torchvision's source, so torchvision need not be installed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, save

STEPS = ("capture", "prepare", "calibrate", "convert", "lower", "save")


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: in-place relus and an in-place residual add."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision.models.resnet18 (same modules, names and forward), random weights."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        cin = 64
        for i, cout in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, cout, stride),
                                                         BasicBlock(cout, cout)))  # fmt: skip
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Speech(nn.Module):
    """A speech encoder: a conv1d front end over 80 mel bins, a 2-layer BiLSTM, CTC logits."""

    def __init__(self, mels: int = 80, hidden: int = 256, classes: int = 29) -> None:
        super().__init__()
        self.front = nn.Sequential(
            nn.Conv1d(mels, hidden, 5, stride=2, padding=2), nn.BatchNorm1d(hidden), nn.ReLU()
        )
        self.lstm = nn.LSTM(hidden, hidden, 2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.front(mel).transpose(1, 2))
        return self.head(out)


def case(name: str, batches: int) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The model (eval mode, batch norm statistics warmed) and its calibration batches."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "resnet18":
        model: nn.Module = ResNet18()
        data = [(torch.randn(4, 3, 224, 224, generator=g),) for _ in range(batches)]
    elif name == "speech":
        model = Speech()
        data = [(torch.randn(8, 80, 200, generator=g),) for _ in range(batches)]
    elif name == "charlm":
        from quantree.workloads.charlm import VOCAB_SIZE, load_charlm

        model = load_charlm()
        data = [(torch.randint(0, VOCAB_SIZE, (16, 128), generator=g),) for _ in range(batches)]
    else:
        raise SystemExit(f"unknown model {name!r}: resnet18, speech or charlm")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        model.train()
        with torch.no_grad():
            for args in data[:2]:
                model(*args)
    return model.eval(), data


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - start_cpu


def float_passes(model: nn.Module, data: list[tuple[torch.Tensor, ...]]) -> None:
    with torch.no_grad():
        for args in data:
            model(*args)


def measure(name: str, batches: int) -> dict[str, tuple[float, float]]:
    model, data = case(name, batches)
    float_passes(model, data[:1])  # warm-up: allocator, first-call dispatch
    times: dict[str, tuple[float, float]] = {}
    _, *times["float"] = timed(lambda: float_passes(model, data))  # type: ignore[assignment]
    gm, *times["capture"] = timed(lambda: qt.capture(model, data[0]))  # type: ignore[assignment]
    prepared, *times["prepare"] = timed(lambda: qt.prepare(gm, qt.Int8Quantizer()))  # type: ignore[assignment]
    _, *times["calibrate"] = timed(lambda: qt.calibrate(prepared, data, progress=False))  # type: ignore[assignment]
    ref, *times["convert"] = timed(lambda: qt.convert(prepared))  # type: ignore[assignment]
    lowered, *times["lower"] = timed(lambda: qt.lower(ref, CPU))  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt2"
        _, *times["save"] = timed(lambda: save(lowered, path, data[0]))  # type: ignore[assignment]
    return times


def row(name: str, threads: int, times: dict[str, tuple[float, float]]) -> str:
    def cell(key: str) -> str:
        wall, cpu = times[key]
        return f"{wall:.2f} ({cpu:.2f})"

    # CPU seconds: on a shared machine wall time counts other jobs' time slices
    rest = sum(times[k][1] for k in STEPS if k != "calibrate")
    ratio = times["calibrate"][1] / times["float"][1]
    steps = " | ".join(cell(k) for k in STEPS)
    return f"| {name} | {threads} | {cell('float')} | {steps} | {ratio:.2f} | {rest:.1f} |"


HEADER = (
    "| model | threads | float | "
    + " | ".join(STEPS)
    + " | calibrate/float | all but calibrate |\n"
    + "|---" * (len(STEPS) + 5)
    + "|"
)


def profile(name: str, batches: int) -> None:
    profiler = cProfile.Profile(time.process_time)  # CPU time: load does not inflate it
    profiler.enable()
    measure(name, batches)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "speech", "charlm"])
    parser.add_argument("--threads", nargs="+", default=["1", "default"])
    parser.add_argument("--batches", type=int, default=8, help="calibration batches")
    parser.add_argument("--profile", metavar="MODEL", help="cProfile one quantize of MODEL")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    if args.profile:
        torch.set_num_threads(1)
        profile(args.profile, args.batches)
        return
    print(f"torch {torch.__version__}, {args.batches} calibration batches; seconds: wall (CPU)")
    print(HEADER)
    for threads in args.threads:
        count = default_threads if threads == "default" else int(threads)
        torch.set_num_threads(count)
        for name in args.models:
            print(row(name, count, measure(name, args.batches)), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
