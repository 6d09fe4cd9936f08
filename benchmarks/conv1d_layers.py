"""1-d convolution layers: the ``[N, C, L]`` kernel against the conv2d-of-height-1 route it
replaced and against float, on ConvTasNet's layer shapes.

    python benchmarks/conv1d_layers.py --runs 20

One thread; per layer the float conv, the old route (the input copied channels-last, split
into byte planes, two conv2d, the result left channels-last and copied contiguous, as the
float op after it did) and the new kernel, interleaved; median thread-CPU microseconds and
the ratio to float from the same rounds. Random int8 weights; the outputs of the two routes
are checked equal first.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_times, one_thread

import quantree.backends.cpu.ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.ops.gemm import as_conv2d_geometry, conv2d
from quantree.backends.cpu.ops.wide import LO_ZERO_POINT, split16
from quantree.backends.cpu.rules.linear import pack_conv_weight

# (name, C, O, kernel, stride, padding, dilation, groups, length)
LAYERS = [
    ("encoder 1->128 k16 s8", 1, 128, 16, 8, 8, 1, 1, 8000),
    ("pointwise 64->128", 64, 128, 1, 1, 0, 1, 1, 1001),
    ("pointwise 128->64", 128, 64, 1, 1, 0, 1, 1, 1001),
    ("depthwise 128 k3 d4", 128, 128, 3, 1, 4, 4, 128, 1001),
]


def old_route(x, x_scale, w, hi_off, hi_scale, lo_off, lo_scale, bias, o, k, s, p, d, groups):
    """``quantree.conv16`` on ``[N, C, L]`` before: two conv2d planes, channels-last out,
    then the contiguous copy the float op reading it made."""
    geometry = as_conv2d_geometry([k], [s], [p], [d])
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    hi, lo = split16(x4, x_scale, -32768, 32767)
    out = conv2d(hi, w, hi_off, hi_scale, None, o, *geometry, 0, 0.0, 0, False, groups)
    low = conv2d(lo, w, lo_off, lo_scale, bias, o, *geometry, LO_ZERO_POINT, 0.0, 0, False,
                 groups)  # fmt: skip
    return out.add_(low).squeeze(2).contiguous()


def measure(layer: tuple, runs: int, gen: torch.Generator) -> str:
    """One table row: the layer's three variants, interleaved."""
    name, c, o, k, s, p, d, groups, length = layer
    values = torch.randint(-127, 128, (o, c // groups, k), generator=gen, dtype=torch.int8)
    w = pack_conv_weight(values, groups)
    hi_off, lo_off = (torch.randint(-999, 999, (o,), generator=gen, dtype=torch.int32)
                      for _ in range(2))  # fmt: skip
    hi_scale, lo_scale = torch.rand(o, generator=gen) * 1e-3, torch.rand(o, generator=gen)
    bias = torch.randn(o, generator=gen)
    x = torch.randn(1, c, length, generator=gen)
    w_float = torch.randn(o, c // groups, k, generator=gen)
    conv = (w, hi_off, hi_scale, lo_off, lo_scale, bias, o)
    geometry = ([k], [s], [p], [d], groups)
    variants = {
        "float": lambda: F.conv1d(x, w_float, bias, s, p, d, groups),
        "old": lambda: old_route(x, 1e-4, *conv, k, s, p, d, groups),
        "new": lambda: torch.ops.quantree.conv16(x, 1e-4, -32768, 32767, *conv, *geometry),
    }
    assert torch.equal(variants["old"](), variants["new"]())
    us = {key: ms * 1e3 for key, (_, ms) in interleaved_times(variants, runs).items()}
    old, new = us["old"] / us["float"], us["new"] / us["float"]
    return (f"| {name} | {us['float']:.0f} | {us['old']:.0f} ({old:.2f}x) "
            f"| {us['new']:.0f} ({new:.2f}x) |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    one_thread()
    gen = torch.Generator().manual_seed(0)
    print(f"load average {' / '.join(f'{v:.2f}' for v in os.getloadavg())}, one thread")
    print("| layer | float us | old route us (x float) | new us (x float) |")
    print("|---|---|---|---|")
    for layer in LAYERS:
        print(measure(layer, args.runs, gen))
    print(f"load average {' / '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
