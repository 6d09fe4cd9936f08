"""``quantree demo``: quantize the bundled character-level LSTM and show what it costs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quantree.metrics import sqnr
from quantree.pipeline import quantize
from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus

BATCH, SEQ = 16, 128


@dataclass(frozen=True)
class DemoRow:
    variant: str
    bits_per_char: float
    logits_sqnr_db: float
    seconds: float


def run_demo(calibration_batches: int = 50, eval_chars: int = 200_000) -> list[DemoRow]:
    model = load_charlm("lstm")
    validation = load_corpus("validation")
    calibration = batches(
        load_corpus("train", max_chars=400_000), BATCH, SEQ, calibration_batches, seed=0
    )
    probe = batches(validation, BATCH, SEQ, 1, seed=1)[0]
    start = time.perf_counter()
    quantized = quantize(model, probe, calibration)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        reference = model(*probe)
        rows = [
            DemoRow(
                "float", bits_per_char(model, validation, SEQ, BATCH, eval_chars), float("inf"), 0.0
            )
        ]
        rows.append(
            DemoRow(
                "int8 whole",
                bits_per_char(quantized, validation, SEQ, BATCH, eval_chars),
                sqnr(reference, quantized(*probe)),
                seconds,
            )
        )
    return rows


def print_rows(rows: list[DemoRow]) -> None:
    base = rows[0].bits_per_char
    print(f"{'variant':<14}{'bits/char':>10}{'vs float':>10}{'logits SQNR':>13}{'quantize s':>12}")
    for r in rows:
        delta = (r.bits_per_char / base - 1) * 100
        print(
            f"{r.variant:<14}{r.bits_per_char:>10.4f}{delta:>+9.2f}%{r.logits_sqnr_db:>10.1f} dB"
            f"{r.seconds:>12.1f}"
        )
