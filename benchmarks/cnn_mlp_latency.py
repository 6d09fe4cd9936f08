"""Conv/linear latency: a small CNN and an MLP, float against int8 flows, one thread.

    python benchmarks/cnn_mlp_latency.py [--runs 25]

Columns: float; PyTorch dynamic int8 (``quantize_dynamic``: linear layers only); PyTorch
eager static int8 (QuantStub/DeQuantStub, conv+relu / linear+relu fused, x86 engine);
quantree lowered to ``quantree.backends.CPU``; ONNX Runtime dynamic int8 when installed.
Ratios are to float measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable

import torch
from common import interleaved_times, load_note, one_thread, table  # benchmarks/ is on the path
from torch import nn

import quantree as qt
from quantree.backends import CPU

COLUMNS = ["float", "torch dynamic", "torch eager static", "quantree cpu"]


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.r1 = nn.Conv2d(3, 32, 3, padding=1), nn.ReLU()
        self.c2, self.r2 = nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU()
        self.c3, self.r3 = nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU()
        self.fc = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.r3(self.c3(self.r2(self.c2(self.r1(self.c1(x))))))
        return self.fc(torch.flatten(y, 1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.r1 = nn.Linear(784, 1024), nn.ReLU()
        self.l2, self.r2 = nn.Linear(1024, 1024), nn.ReLU()
        self.l3 = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.r2(self.l2(self.r1(self.l1(x)))))


FUSE = {
    SmallCnn: [["c1", "r1"], ["c2", "r2"], ["c3", "r3"]],
    Mlp: [["l1", "r1"], ["l2", "r2"]],
}


class Stubbed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.quant, self.inner = torch.ao.quantization.QuantStub(), inner
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.inner(self.quant(x)))


def eager_static(model: nn.Module, calib: list[tuple[torch.Tensor]]) -> nn.Module:
    aq = torch.ao.quantization
    inner = aq.fuse_modules(copy.deepcopy(model).eval(), FUSE[type(model)])
    stubbed = Stubbed(inner).eval()
    stubbed.qconfig = aq.get_default_qconfig("x86")
    torch.backends.quantized.engine = "x86"
    prepared = aq.prepare(stubbed)
    with torch.no_grad():
        for (x,) in calib:
            prepared(x)
    return aq.convert(prepared)


def variants(model: nn.Module, shape: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    model = model.eval()
    x = torch.randn(*shape)
    calib = [(torch.randn(*shape),) for _ in range(4)]
    dynamic = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    static = eager_static(model, calib)
    lowered = qt.quantize(model, (x,), calib, backend=CPU, progress=False)
    return {
        "float": lambda: model(x),
        "torch dynamic": lambda: dynamic(x),
        "torch eager static": lambda: static(x),
        "quantree cpu": lambda: lowered(x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25, help="timed rounds (median of these)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="also print the thread-CPU-time table of the same rounds (steadier under load)",
    )
    args = parser.parse_args()
    one_thread()
    cases = [
        ("small CNN, 8x3x32x32", SmallCnn(), (8, 3, 32, 32)),
        ("small CNN, 1x3x32x32", SmallCnn(), (1, 3, 32, 32)),
        ("MLP 784-1024-1024-10, batch 64", Mlp(), (64, 784)),
        ("MLP 784-1024-1024-10, batch 1", Mlp(), (1, 784)),
    ]
    rows, cpu_rows = [], []
    for label, model, shape in cases:
        times = interleaved_times(variants(model, shape), args.runs)
        rows.append((label, {name: wall for name, (wall, _) in times.items()}))
        cpu_rows.append((label, {name: cpu for name, (_, cpu) in times.items()}))
        print(f"measured {label}", file=sys.stderr)
    print(table("conv / linear (1 thread, median ms, ratio to float)", COLUMNS, rows))
    if args.cpu_time:
        title = "conv / linear (1 thread, median thread-CPU ms, ratio to float)"
        print()
        print(table(title, COLUMNS, cpu_rows))
    print(f"\n{load_note()}; torch {torch.__version__}; {args.runs} interleaved rounds")


if __name__ == "__main__":
    main()
