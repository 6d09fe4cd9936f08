"""quantree's int8 conv/linear kernels against PyTorch's oneDNN int8 ops, per shape, one thread.

    python benchmarks/onednn_kernels.py [--runs 15]

The oneDNN ops are the ones Inductor lowers X86InductorQuantizer models to:
``onednn.qconv2d_pointwise`` on a ``onednn.qconv_prepack``-ed weight and
``onednn.qlinear_pointwise`` on a ``onednn.qlinear_prepack``-ed one. quantree's activations
are int8 (zero point in [-128, 127]); oneDNN's x86 path takes uint8 activations only (an
int8 input falls to a reference path hundreds of times slower), so the oneDNN column is what
quantree would run: the input's sign bit flipped (``x ^ 0x80``: the same values on zero point
+128, one pass over the input) and int8 written out (``output_dtype=int8``), relu fused,
channels-last as quantree's convs keep it. ``core`` is the oneDNN call alone on an input
already uint8. quantree's column is the lowered model's own node (its packed weight), called
as the lowered graph calls it. Medians of process CPU time, the two columns interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from common import load_note, one_thread
from torch import fx, nn

import quantree as qt
from quantree.backends import CPU

CONVS = [  # (in, out, size, kernel, stride): resnet18's at 224, then the small CNN's at 32
    (3, 64, 224, 7, 2), (64, 64, 56, 3, 1), (64, 128, 56, 3, 2), (64, 128, 56, 1, 2),
    (128, 128, 28, 3, 1), (128, 256, 28, 3, 2), (256, 256, 14, 3, 1), (256, 512, 14, 3, 2),
    (512, 512, 7, 3, 1), (3, 32, 32, 3, 1), (32, 64, 32, 3, 2), (64, 64, 16, 3, 2),
]  # fmt: skip
LINEARS = [  # (rows, in, out): BERT's (128 tokens), DeepSpeech's (100 frames), MLP batch 1
    (128, 128, 128), (128, 128, 512), (128, 512, 128), (100, 40, 512), (100, 512, 512),
    (1, 784, 1024), (1, 4096, 10),
]  # fmt: skip


def interleaved(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    for fn in calls.values():
        for _ in range(3):
            fn()
    ms: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(runs):
        for name in names[r % 2 :] + names[: r % 2]:
            start = time.process_time()
            calls[name]()
            ms[name].append((time.process_time() - start) * 1e3)
    return {k: statistics.median(v) for k, v in ms.items()}


def first_node_call(
    model: nn.Module, x: torch.Tensor, word: str, reduce_range: bool = False
) -> Callable[[], object]:
    """quantree's lowered node for the model's first layer, on the input it receives
    (``reduce_range``: with 7-bit weights, ``Int8Quantizer(reduce_range=True)``)."""
    calib = [(torch.randn_like(x),) for _ in range(2)]
    quantizer = qt.Int8Quantizer(reduce_range=reduce_range)
    low = qt.quantize(model, (x,), calib, quantizer=quantizer, backend=CPU, progress=False,
                      dynamic_batch=False)  # fmt: skip
    seen: dict[fx.Node, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            seen[n] = super().run_node(n)
            return seen[n]

    Recorder(low).run(x)
    node = next(n for n in low.graph.nodes if word in str(n.target))
    args = [seen[a] if isinstance(a, fx.Node) else a for a in node.args]
    return lambda: node.target(*args)  # type: ignore[operator]


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(tuple(range(1, w.dim()))) / 127
    shape = (-1,) + (1,) * (w.dim() - 1)
    return torch.round(w / scale.reshape(shape)).to(torch.int8), scale


def conv_row(cin: int, cout: int, size: int, k: int, s: int, runs: int, r7: bool = False) -> str:
    model = nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2), nn.ReLU()).eval()
    x = torch.randn(1, cin, size, size)
    ours = first_node_call(model, x, "conv2d")
    ours7 = first_node_call(model, x, "conv2d", reduce_range=True) if r7 else None
    wq, w_scale = int8_weight(model[0].weight.detach())
    bias, x_scale = model[0].bias.detach(), float(x.abs().max() / 127)
    geometry = ([s, s], [k // 2, k // 2], [1, 1], 1)
    packed = torch.ops.onednn.qconv_prepack(wq, w_scale, x_scale, 128, *geometry, list(x.shape))
    w_zp = torch.zeros(cout, dtype=torch.int64)
    q8 = (torch.randint(-128, 128, x.shape, dtype=torch.int8)).contiguous(
        memory_format=torch.channels_last
    )
    u8 = q8.view(torch.uint8) ^ 0x80
    conv = torch.ops.onednn.qconv2d_pointwise

    def onednn(a: torch.Tensor, flip: bool) -> torch.Tensor:
        a = a.view(torch.uint8) ^ 0x80 if flip else a
        return conv(a, x_scale, 128, packed, w_scale, w_zp, bias, *geometry, 0.05, -128,
                    torch.int8, "relu", [], "")  # fmt: skip

    calls = {"q": ours, "o": lambda: onednn(q8, True), "c": lambda: onednn(u8, False)}
    if ours7 is not None:
        calls["r"] = ours7
    ms = interleaved(calls, runs)
    label = f"conv {cin}->{cout}, {size}x{size}, k{k} s{s}"
    r7_cell = f" {ms['r']:.3f} ({ms['r'] / ms['q']:.2f}) |" if ours7 is not None else ""
    return (
        f"| {label} | {ms['q']:.3f} |{r7_cell} {ms['o']:.3f} ({ms['o'] / ms['q']:.2f}) "
        f"| {ms['c']:.3f} |"
    )


def linear_row(m: int, k: int, n: int, runs: int) -> str:
    model = nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, 4)).eval()
    x = torch.randn(m, k)
    ours = first_node_call(model, x, "linear")
    wq, w_scale = int8_weight(model[0].weight.detach())
    bias, x_scale = model[0].bias.detach(), float(x.abs().max() / 127)
    packed = torch.ops.onednn.qlinear_prepack(wq, [m, k])
    w_zp = torch.zeros(n, dtype=torch.int64)
    q8 = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    u8 = q8.view(torch.uint8) ^ 0x80
    linear = torch.ops.onednn.qlinear_pointwise

    def onednn(a: torch.Tensor, flip: bool) -> torch.Tensor:
        a = a.view(torch.uint8) ^ 0x80 if flip else a
        return linear(a, x_scale, 128, packed, w_scale, w_zp, bias, 0.05, -128, torch.int8,
                      "relu", [], "")  # fmt: skip

    ms = interleaved(
        {"q": ours, "o": lambda: onednn(q8, True), "c": lambda: onednn(u8, False)}, runs
    )
    label = f"linear {m}x{k} -> {n}"
    return f"| {label} | {ms['q']:.3f} | {ms['o']:.3f} ({ms['o'] / ms['q']:.2f}) | {ms['c']:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument(
        "--r7", action="store_true", help="a column of quantree with 7-bit weights (convs)"
    )
    parser.add_argument("--convs-only", action="store_true")
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    r7_head = " quantree 7-bit weights ms (ratio) |" if args.r7 else ""
    print(f"| layer | quantree ms |{r7_head} oneDNN ms, int8 in/out (ratio) | oneDNN core ms |")
    print("|---|---|" + ("---|" if args.r7 else "") + "---|---|")
    with torch.no_grad():  # not inference_mode: see benchmarks/README.md
        for shape in CONVS:
            print(conv_row(*shape, args.runs, args.r7), flush=True)
        for m, k, n in [] if args.convs_only else LINEARS:
            print(linear_row(m, k, n, args.runs), flush=True)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    main()
