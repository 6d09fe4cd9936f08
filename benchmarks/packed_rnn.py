"""A stacked bidirectional LSTM on a packed sequence: float, whole mode, cells mode.

Whole mode runs every layer and direction of a packed call in one native call
(``qt_rnn_packed``). The column "whole, per length" runs the same lowered op's arguments the
way it ran before that kernel: one padded ``quantree::rnn`` call per group of sequences of
one length (``by_length``), in the same rounds, so the two are an in-process A/B on the same
weights and grids. Interleaved rounds, thread-CPU medians, ratios to float of the same run.

    python benchmarks/packed_rnn.py [--runs N] [--hidden 256] [--batch 32] [--steps 100]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
from common import interleaved_times, load_note, one_thread
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.direct import DirectCall
from quantree.backends.cpu.ops.recurrent.rnn import rnn


class Packed(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(hidden, hidden, 2, bidirectional=True)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        return pad_packed_sequence(self.rnn(packed)[0], total_length=x.shape[0])[0]


def by_length(
    x: Tensor,
    batch_sizes: Tensor,
    states: list[Tensor],
    run: Callable[[Tensor, list[Tensor]], tuple[Tensor, list[Tensor]]],
) -> tuple[Tensor, list[Tensor]]:
    """The previous packed whole-mode op: ``run`` once per group of equal lengths on its
    padded rows (states hold the batch on dim 1)."""
    sizes = batch_sizes.to(torch.int64)
    batch = int(sizes[0])
    mask = torch.arange(batch) < sizes[:, None]
    padded = x.new_zeros((len(sizes), batch, *x.shape[1:]))
    padded[mask] = x
    lengths = mask.sum(0).tolist()
    out: Tensor | None = None
    finals = [s.clone() for s in states]
    start = 0
    while start < batch:
        length = lengths[start]
        end = start + lengths.count(length)
        group = [s.narrow(1, start, end - start).contiguous() for s in states]
        y, group_finals = run(padded[:length, start:end].contiguous(), group)
        if out is None:
            out = y.new_zeros((len(sizes), batch, *y.shape[2:]))
        out[:length, start:end] = y
        for final, g in zip(finals, group_finals, strict=True):
            final.narrow(1, start, end - start).copy_(g)
        start = end
    assert out is not None
    return out[mask], finals


def lengths_with(distinct: int, steps: int, batch: int, g: torch.Generator) -> Tensor:
    """``batch`` lengths up to ``steps`` (the longest once) with ``distinct`` values."""
    values = torch.randperm(steps - 1, generator=g)[: distinct - 1] + 1
    picks = values[torch.randint(0, len(values), (batch - 1,), generator=g)]
    picks[: len(values)] = values  # each value at least once
    return torch.cat([torch.tensor([steps]), picks])[torch.randperm(batch, generator=g)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--distinct", type=int, default=29)
    args = parser.parse_args()
    one_thread()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Packed(args.hidden).eval()

    def sample() -> tuple[Tensor, Tensor]:
        x = torch.randn(args.steps, args.batch, args.hidden, generator=g)
        return x, lengths_with(args.distinct, args.steps, args.batch, g)

    data = [sample() for _ in range(4)]
    lowered = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        for mode in (qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS):
            quantizer = qt.Int8Quantizer(recurrent=mode)
            lowered[mode.value] = qt.quantize(
                model, data[0], data, quantizer=quantizer, backend=CPU, progress=False
            )
    x, lengths = data[0]
    (node,) = [n for n in lowered["whole"].graph.nodes if "rnn_packed" in str(n.target)]
    variants = {
        "float": lambda: model(x, lengths),
        "whole": lambda: lowered["whole"](x, lengths),
        "cells": lambda: lowered["cells"](x, lengths),
    }
    if isinstance(node.target, DirectCall):  # else a checkout before the one-call kernel
        variants |= op_variants(node.target, lowered["whole"], x, lengths)
    distinct = len(set(lengths.tolist()))
    print(f"LSTM {args.hidden} x 2 bidirectional, batch {args.batch}, {args.steps} steps, "
          f"{distinct} distinct lengths; {load_note()}")  # fmt: skip
    times = interleaved_times(variants, args.runs)
    base = times["float"][1]
    for name, (wall, cpu) in times.items():
        print(f"{name:>16}: {cpu:8.2f} ms CPU ({cpu / base:.2f}x float), wall {wall:8.2f} ms")
    print(load_note())


def op_variants(
    target: DirectCall, gm: Callable[..., object], x: Tensor, lengths: Tensor
) -> dict[str, Callable[[], object]]:
    """The lowered op's arguments run in one call and, as before, per length."""
    runner, seen = target.implementation, []
    target.implementation = lambda *a: seen.append(a) or runner(*a)
    gm(x, lengths)
    target.implementation = runner
    kind, rows, sizes, hx, params, hidden, layers, bidir, qparams, bits, proj, *flags = seen[0]
    assert not any(flags), "the previous way took int8 in and out only"

    def per_length() -> object:
        def run(xs: Tensor, states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            y, h_n, c_n = rnn(kind, xs, states, params, hidden, layers, bidir, False, qparams,
                              bits, proj)  # fmt: skip
            return y, [h_n, c_n]

        return by_length(rows, sizes, hx, run)

    def one_call() -> object:
        return runner(
            kind, rows, sizes, hx, params, hidden, layers, bidir, qparams, bits, proj, *flags
        )

    return {"op, one call": one_call, "op, per length": per_length}


if __name__ == "__main__":
    main()
