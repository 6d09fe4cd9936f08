"""Issue 27's acceptance lines other than the zoo's, on what ``qt.quantize`` does by default.

Each line is measured on the lowered CPU model a user gets from ``qt.quantize`` (its default
recipe, range search and ``refine="auto"``), not on hand-picked options; the w4a8 line names
its recipe (``W4A8Quantizer`` is an explicit choice). One thread.

    cd benchmarks && PYTHONPATH=../src:. python issue27_lines.py [lstm crnn distilbert charlm]

- ``lstm``: the issue's LSTM(50, 50) with random initial states and three linear consumers
  (out, h, c), 20 calibration batches of 4 x 10, 5 new inputs; every leaf's SQNR against
  float on each new input, 4 seeds (model and data); whole and cells mode.
- ``crnn``: the zoo's CRNN (VGG front + 2-layer bidirectional GRU) and the same model with a
  bidirectional LSTM (the issue's "VGG + BiLSTM"), whole and cells mode, the zoo's data and
  input-dependent SQNR (16 calibration batches, 8 held-out inputs).
- ``distilbert``: the zoo's DistilBERT (2 layers, dim 128, vocab 1000) against torchao.
- ``charlm``: the bundled char-LM, bits/char on 50 000 validation characters against float
  (int8 whole, int8 cells, w4a8 groups of 16 with range search and refine), the saved size of
  the lowered w4a8 model against the int8 one, and their latency interleaved in one process.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from common import interleaved_times, load_note, one_thread
from torch import nn
from torch.utils._pytree import tree_leaves
from zoo import (
    CRNN,
    Case,
    build,
    flat,
    input_dependent_sqnr,
    randn,
    torchao_variant,
    warm_batch_norm,
)

import quantree as qt
from quantree.backends import CPU, save

WHOLE, CELLS = qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS


def quantized(model: nn.Module, calib: list, quantizer: qt.Quantizer | None = None,
              refine: qt.Refine | str | None = "auto") -> tuple[nn.Module, float]:  # fmt: skip
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = qt.quantize(model, calib[0], calib, quantizer=quantizer, backend=CPU,
                        progress=False, refine=refine)  # fmt: skip
    return q, time.process_time() - start


class IssueLSTM(nn.Module):
    """Issue 27's LSTM(50, 50) with random initial states and three linear consumers."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(50, 50, batch_first=True)
        self.out, self.h, self.c = nn.Linear(50, 10), nn.Linear(50, 10), nn.Linear(50, 10)

    def forward(self, x, h, c):
        y, (hn, cn) = self.rnn(x, (h, c))
        return self.out(y), self.h(hn), self.c(cn)


def lstm_lines() -> None:
    print("\n| LSTM(50,50), 3 consumers | seed | worst leaf on each of 5 new inputs | worst |")
    print("| --- | --- | --- | --- |")
    for mode in (WHOLE, CELLS):
        overall = []
        for seed in range(4):
            torch.manual_seed(seed)
            model = IssueLSTM().eval()
            g = torch.Generator().manual_seed(100 + seed)

            def batch(g=g):
                shapes = ((4, 10, 50), (1, 4, 50), (1, 4, 50))
                return tuple(torch.randn(*s, generator=g) for s in shapes)

            calib, new = [batch() for _ in range(20)], [batch() for _ in range(5)]
            q, _ = quantized(model, calib, qt.Int8Quantizer(recurrent=mode))
            per_input = []
            with torch.no_grad():
                for x in new:
                    pairs = zip(tree_leaves(model(*x)), tree_leaves(q(*x)), strict=True)
                    per_input.append(min(float(qt.sqnr(a, b)) for a, b in pairs))
            overall.append(min(per_input))
            cells = " / ".join(f"{v:.1f}" for v in per_input)
            print(f"| {mode.value} | {seed} | {cells} dB | {min(per_input):.1f} dB |", flush=True)
        print(f"| {mode.value} | all | | **{min(overall):.1f} dB** |", flush=True)


def bilstm_crnn() -> nn.Module:
    model = CRNN()
    model.rnn = nn.LSTM(256, 128, num_layers=2, bidirectional=True, batch_first=True)
    return model


def zoo_data(model: nn.Module, sample: Callable) -> tuple[list, list, Callable]:
    gen = torch.Generator().manual_seed(1)
    warm_batch_norm(model, Case(model, sample), gen)
    calib = [sample(gen) for _ in range(16)]
    held = [sample(gen) for _ in range(8)]
    with torch.no_grad():
        want = [flat(model(*a)) for a in held]

    def score(q: Callable) -> float:
        with torch.no_grad():
            return input_dependent_sqnr(want, [flat(q(*a)) for a in held])

    return calib, held, score


def crnn_lines() -> None:
    print("\n| CRNN | whole | cells | cells - whole | quantize CPU s whole / cells |")
    print("| --- | --- | --- | --- | --- |")
    for name, make in (("VGG + BiGRU (zoo)", CRNN), ("VGG + BiLSTM", bilstm_crnn)):
        torch.manual_seed(0)
        model = make().eval()
        calib, _, score = zoo_data(model, randn(1, 1, 32, 128))
        got = {}
        for mode in (WHOLE, CELLS):
            q, secs = quantized(model, calib, qt.Int8Quantizer(recurrent=mode))
            got[mode] = (score(q), secs)
        (w, ws), (c, cs) = got[WHOLE], got[CELLS]
        print(f"| {name} | {w:.1f} dB | {c:.1f} dB | {c - w:+.1f} dB | {ws:.1f} / {cs:.1f} |",
              flush=True)  # fmt: skip


def distilbert_lines() -> None:
    torch.manual_seed(0)
    case = build("distilbert")
    case.model.eval()
    calib, held, score = zoo_data(case.model, case.sample)
    q, secs = quantized(case.model, calib)
    ao = torchao_variant(case, calib)[0]
    times = interleaved_times(
        {"float": lambda: case.model(*held[0]), "q": lambda: q(*held[0]),
         "ao": lambda: ao(*held[0])}, 10, warmup=3)  # fmt: skip
    f = times["float"][1]
    print("\n| DistilBERT | quantree | torchao | CPU ratio quantree / torchao |")
    print("| --- | --- | --- | --- |")
    print(f"| 2 layers, dim 128 | {score(q):.1f} dB ({secs:.1f} s) | {score(ao):.1f} dB | "
          f"{times['q'][1] / f:.2f}x / {times['ao'][1] / f:.2f}x |", flush=True)  # fmt: skip


def charlm_lines() -> None:
    from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus

    model = load_charlm("lstm")
    validation = load_corpus("validation")[:50_001]
    train = load_corpus("train", max_chars=400_000)
    calib = batches(train, 16, 128, 20, seed=0)
    base = bits_per_char(model, validation, 128, 16)
    search = qt.ObserverKind.SEARCH
    variants = {
        "int8 whole (default)": (qt.Int8Quantizer(), "auto"),
        "int8 cells (default cells)": (qt.Int8Quantizer(recurrent=CELLS), "auto"),
        "w4a8 groups of 16, search + refine": (
            qt.W4A8Quantizer(activation_observer=search, weight_observer=search, group_size=16),
            qt.Refine(),
        ),
    }
    print(f"\n| char-LM (float {base:.4f} bits/char) | bits/char | vs float | saved bytes | "
          "vs int8 whole | quantize CPU s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    lowered, sizes = {}, {}
    for name, (quantizer, refine) in variants.items():
        q, secs = quantized(model, calib, quantizer, refine)
        bpc = bits_per_char(q, validation, 128, 16)
        with tempfile.TemporaryDirectory() as tmp:
            save(q, f"{tmp}/m.pt2", calib[0])
            sizes[name] = os.path.getsize(f"{tmp}/m.pt2")
        lowered[name] = q
        first = sizes[next(iter(sizes))]
        print(f"| {name} | {bpc:.4f} | {100 * (bpc / base - 1):+.3f}% | {sizes[name]} | "
              f"{sizes[name] / first:.2f}x | {secs:.1f} |", flush=True)  # fmt: skip
    (x,) = calib[0]
    names = list(lowered)
    for run in (1, 2):
        times = interleaved_times({n: (lambda q=lowered[n]: q(x)) for n in names}, 20, warmup=3)
        (w8, c8) = times[names[0]]
        (w4, c4) = times[names[2]]
        print(
            f"run {run}: w4a8 / int8 whole, batch {tuple(x.shape)}: CPU {c4 / c8:.3f} "
            f"({c4:.2f} / {c8:.2f} ms), wall {w4 / w8:.3f}; {load_note()}",
            flush=True,
        )


def main(which: list[str]) -> None:
    one_thread()
    print(f"{load_note()}, torch {torch.__version__}, one thread")
    for name in which:
        {"lstm": lstm_lines, "crnn": crnn_lines, "distilbert": distilbert_lines,
         "charlm": charlm_lines}[name]()  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:] or ["lstm", "crnn", "distilbert", "charlm"])
