"""Accuracy algorithms: what range search (``ObserverKind.SEARCH``) and ``qt.refine`` gain.

For each model, the int8 recipe as it comes (``Int8Quantizer()``: range search for int8
activations, min-max weights), and with min-max ranges (the default before issue 27)
against: SEARCH for activations and weights; min-max plus ``refine``; SEARCH plus
``refine``. Accuracy is the zoo's input-dependent SQNR on held-out inputs (the char-LM:
bits/char on validation text; the issue's LSTM: the worst output leaf over new inputs),
read on the reference graph (lowering computes the same integers). Times are CPU seconds,
one thread: calibration (prepare + calibrate + convert) and refine apart. torchao's X86
recipe is the anchor where it runs (not on recurrent models, which it leaves float).

    PYTHONPATH=src python benchmarks/accuracy_algorithms.py [lstm crnn charlm distilbert]
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import quantree as qt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from zoo import (
    CRNN,
    Case,
    flat,
    import_model_libraries,
    input_dependent_sqnr,
    randn,
    torchao_variant,
    warm_batch_norm,
)

MINMAX, SEARCH = qt.ObserverKind.MINMAX, qt.ObserverKind.SEARCH
RULES: tuple[qt.Rule, ...] = ()  # the recipe's own rules, added last
OPTIONS: dict[str, Any] = {}  # further Int8Quantizer options of a row
FLOAT_TABLE = (qt.Rule((torch.ops.aten.embedding,), lambda n: qt.Annotation()),)
VARIANTS: dict[str, tuple[qt.ObserverKind | None, bool]] = {
    "default": (None, False),  # what Int8Quantizer() calibrates with (range search)
    "min-max": (MINMAX, False),
    "search": (SEARCH, False),
    "min-max + refine": (MINMAX, True),
    "search + refine": (SEARCH, True),
}


def quantized(model: nn.Module, calib: list[tuple], kind: qt.ObserverKind | None, refine: bool,
              mode: qt.RecurrentMode) -> tuple[Any, float, float]:  # fmt: skip
    kinds = {} if kind is None else {"activation_observer": kind, "weight_observer": kind}
    quantizer = qt.Int8Quantizer(recurrent=mode, rules=RULES, **kinds, **OPTIONS)
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, calib[0]), quantizer)
        qt.calibrate(prepared, calib, progress=False)
        ref = qt.convert(prepared)
    calibrated = time.process_time() - start
    start = time.process_time()
    if refine:
        ref = qt.refine(prepared, ref, calib)
    return ref, calibrated, time.process_time() - start


def sqnr_on(model: nn.Module, held: list[tuple]) -> Callable[[Any], float]:
    with torch.no_grad():
        want = [flat(model(*a)) for a in held]

    def score(q: Any) -> float:
        with torch.no_grad():
            return input_dependent_sqnr(want, [flat(q(*a)) for a in held])

    return score


class IssueLSTM(nn.Module):
    """Issue 27's LSTM(50, 50) with random initial states and three linear consumers."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(50, 50, batch_first=True)
        self.out, self.h, self.c = nn.Linear(50, 10), nn.Linear(50, 10), nn.Linear(50, 10)

    def forward(self, x, h, c):
        y, (hn, cn) = self.rnn(x, (h, c))
        return self.out(y), self.h(hn), self.c(cn)


I8 = qt.QDtype.INT8
CELL8 = {"cell_state_dtype": I8, "gate_dtype": I8, "cell_sums_dtype": I8}
MODES = [(m.value, m, {}) for m in qt.RecurrentMode] + [
    ("cells, all-int8 cell (cell state, gates, sums int8)", qt.RecurrentMode.CELLS, CELL8)
]  # cells mode's default: int16 cell state, gates and sums


def lstm_rows() -> list[str]:
    """Worst output leaf over 5 new inputs, worst over 4 seeds (model and data)."""
    global OPTIONS
    rows = []
    for label, mode, options in MODES:
        OPTIONS = options
        worst = {name: [] for name in VARIANTS}
        times = {name: 0.0 for name in VARIANTS}
        for seed in range(4):
            torch.manual_seed(seed)
            model = IssueLSTM().eval()
            g = torch.Generator().manual_seed(100 + seed)

            def batch(g=g):
                return (torch.randn(4, 10, 50, generator=g), torch.randn(1, 4, 50, generator=g),
                        torch.randn(1, 4, 50, generator=g))  # fmt: skip

            calib, new = [batch() for _ in range(20)], [batch() for _ in range(5)]
            for name, (kind, refine) in VARIANTS.items():
                q, cal_s, ref_s = quantized(model, calib, kind, refine, mode)
                times[name] += cal_s + ref_s
                with torch.no_grad():
                    leaves = [
                        float(qt.sqnr(a, b))
                        for x in new
                        for a, b in zip(tree_leaves(model(*x)), tree_leaves(q(*x)), strict=True)
                    ]
                worst[name].append(min(leaves))
        cells = " | ".join(f"{min(worst[n]):.1f} dB ({times[n] / 4:.1f} s)" for n in VARIANTS)
        rows.append(f"| LSTM(50,50), 3 heads, {label}: worst leaf | {cells} | - |")
    OPTIONS = {}
    return rows


def zoo_like_rows(name: str, model: nn.Module, sample: Callable, modes: list[qt.RecurrentMode],
                  anchor: bool) -> list[str]:  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    warm_batch_norm(model, Case(model, sample), gen)
    calib = [sample(gen) for _ in range(16)]
    held = [sample(gen) for _ in range(8)]
    score = sqnr_on(model, held)
    rows = []
    anchor_cell = "-"
    if anchor:
        try:
            ao = torchao_variant(Case(model, sample), calib)[0]
            anchor_cell = f"{score(ao):.1f} dB"
        except Exception as err:
            anchor_cell = f"fails: {type(err).__name__}"
    for mode in modes:
        cells = []
        for kind, refine in VARIANTS.values():
            q, cal_s, ref_s = quantized(model, calib, kind, refine, mode)
            extra = f" + {ref_s:.1f}" if refine else ""
            cells.append(f"{score(q):.1f} dB ({cal_s:.1f}{extra} s)")
        label = f"{name}, {mode.value}" if len(modes) > 1 else name
        rows.append(f"| {label} | {' | '.join(cells)} | {anchor_cell} |")
    return rows


def charlm_rows() -> list[str]:
    from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus

    model = load_charlm("lstm")
    validation = load_corpus("validation")[:50_001]
    train = load_corpus("train", max_chars=400_000)
    calib = batches(train, 16, 128, 20, seed=0)
    base = bits_per_char(model, validation, 128, 16)
    global OPTIONS
    rows = []
    for label, mode, options in MODES:
        OPTIONS = options
        cells = []
        for kind, refine in VARIANTS.values():
            q, cal_s, ref_s = quantized(model, calib, kind, refine, mode)
            bpc = bits_per_char(q, validation, 128, 16)
            extra = f" + {ref_s:.1f}" if refine else ""
            cells.append(f"{100 * (bpc / base - 1):+.2f}% ({cal_s:.1f}{extra} s)")
        rows.append(f"| char-LM {label}: bits/char vs float {base:.4f} | "
                    f"{' | '.join(cells)} | - |")  # fmt: skip
    OPTIONS = {}
    return rows


def distilbert() -> tuple[nn.Module, Callable]:
    import_model_libraries()
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=4, hidden_dim=512)
    torch.manual_seed(0)
    model = DistilBertModel(config).eval()

    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, ids):
            return self.inner(input_ids=ids).last_hidden_state

    return Hidden().eval(), lambda g: (torch.randint(0, 1000, (2, 32), generator=g),)


def main(which: list[str]) -> None:
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}")
    print("| model | " + " | ".join(VARIANTS) + " | torchao |")
    print("| --- " * (len(VARIANTS) + 2) + "|")
    if "lstm" in which:
        print("\n".join(lstm_rows()), flush=True)
    if "crnn" in which:
        torch.manual_seed(0)
        print("\n".join(zoo_like_rows("CRNN", CRNN().eval(), randn(1, 1, 32, 128),
                                      list(qt.RecurrentMode), False)), flush=True)  # fmt: skip
    if "distilbert" in which:
        model, sample = distilbert()
        print("\n".join(zoo_like_rows("DistilBERT (2 layers, dim 128)", model, sample,
                                      [qt.RecurrentMode.WHOLE], True)), flush=True)  # fmt: skip
        global RULES
        RULES = FLOAT_TABLE  # torchao leaves the token table float; so does this row
        print("\n".join(zoo_like_rows("DistilBERT, float embedding table", model, sample,
                                      [qt.RecurrentMode.WHOLE], True)), flush=True)  # fmt: skip
        RULES = ()
        global OPTIONS
        OPTIONS = {"embedding_dtype": qt.QDtype.INT16}
        print("\n".join(zoo_like_rows("DistilBERT, int16 embedding table", model, sample,
                                      [qt.RecurrentMode.WHOLE], True)), flush=True)  # fmt: skip
        OPTIONS = {}
    if "charlm" in which:
        print("\n".join(charlm_rows()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["lstm", "crnn", "distilbert", "charlm"])
