"""Accuracy goals on the bundled char-level LSTM, on a shortened validation set.

Whole-mode int8 (per-channel int8 weights, int8 activations): bits per character within 0.3%
of float and logits SQNR >= 30 dB. The calibration time of the demo's 50 batches is printed
(a benchmark figure, never asserted).

Cells mode (issue 5), lowered to the CPU backend's native cell loops: the integer-LSTM
recipe (int16 cell state and gates) within 1% of float and logits SQNR >= 25 dB; int8 with
an int16 cell state within 2%. Cells calibration is slower per batch, so these calibrate on
the first 16 of the 50 batches.
"""

from __future__ import annotations

import time

import pytest
import torch

import quantree as qt
from quantree.backends import CPU
from quantree.tools.compare import compare
from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus, weights_path

BATCH, SEQ = 16, 128
EVAL_CHARS = 60_000  # ~29 batches of 16 x 128: a shortened validation set
CALIBRATION_BATCHES = 50


@pytest.fixture(scope="module")
def workload():
    model = load_charlm("lstm")
    validation = load_corpus("validation")[: EVAL_CHARS + 1]
    calibration = batches(
        load_corpus("train", max_chars=400_000), BATCH, SEQ, CALIBRATION_BATCHES, seed=0
    )
    probes = batches(validation, BATCH, SEQ, 4, seed=1)
    float_bpc = bits_per_char(model, validation, SEQ, BATCH)
    return model, validation, calibration, probes, float_bpc


def test_float_model_is_a_real_model(workload) -> None:
    *_, float_bpc = workload
    assert float_bpc < 2.0


def test_whole_mode_int8_accuracy(workload) -> None:
    model, validation, calibration, probes, float_bpc = workload
    prepared = qt.prepare(qt.capture(model, calibration[0]), qt.Int8Quantizer())
    start = time.perf_counter()
    qt.calibrate(prepared, calibration, progress=False)
    seconds = time.perf_counter() - start
    print(f"\ncalibration of {CALIBRATION_BATCHES} batches of {BATCH}x{SEQ}: {seconds:.2f} s")
    converted = qt.convert(prepared)
    with torch.no_grad():
        bpc = bits_per_char(converted, validation, SEQ, BATCH)
    logits_db = compare(model, converted, probes).outputs[0].sqnr_db
    delta = bpc / float_bpc - 1.0
    print(f"float {float_bpc:.4f} bpc, int8 whole {bpc:.4f} ({delta:+.2%}), {logits_db:.1f} dB")
    assert abs(delta) <= 0.003
    assert logits_db >= 30.0


@pytest.mark.skipif(not weights_path("gru").exists(), reason="GRU weights not bundled yet")
def test_whole_mode_int8_accuracy_gru(workload) -> None:
    _, validation, calibration, probes, _ = workload
    model = load_charlm("gru")
    float_bpc = bits_per_char(model, validation, SEQ, BATCH)
    assert float_bpc < 2.0
    quantized = qt.quantize(model, calibration[0], calibration, progress=False, backend="reference")
    with torch.no_grad():
        bpc = bits_per_char(quantized, validation, SEQ, BATCH)
    logits_db = compare(model, quantized, probes).outputs[0].sqnr_db
    print(f"\nGRU: float {float_bpc:.4f} bpc, int8 whole {bpc:.4f}, {logits_db:.1f} dB")
    assert abs(bpc / float_bpc - 1.0) <= 0.003
    assert logits_db >= 30.0


CELLS_CALIBRATION_BATCHES = 16
CELLS_GOALS = {  # recipe options, largest relative bits/char change, smallest logits SQNR
    "integer-lstm": (
        {"cell_state_dtype": qt.QDtype.INT16, "gate_dtype": qt.QDtype.INT16},
        0.01,
        25.0,
    ),
    "int8-int16-cell": ({"cell_state_dtype": qt.QDtype.INT16}, 0.02, None),
}


@pytest.mark.parametrize(("options", "max_delta", "min_db"), CELLS_GOALS.values(), ids=CELLS_GOALS)
def test_cells_mode_accuracy_on_cpu(workload, options, max_delta, min_db) -> None:
    model, validation, calibration, probes, float_bpc = workload
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS, **options)
    cal = calibration[:CELLS_CALIBRATION_BATCHES]
    lowered = qt.quantize(model, cal[0], cal, quantizer=quantizer, backend=CPU, progress=False)
    loops = {type(m).__name__ for m in lowered.modules() if "CellLoop" in type(m).__name__}
    assert loops == {"NativeCellLoop"}  # the native program, not the float reference loop
    with torch.no_grad():
        bpc = bits_per_char(lowered, validation, SEQ, BATCH)
    logits_db = compare(model, lowered, probes).outputs[0].sqnr_db
    delta = bpc / float_bpc - 1.0
    print(f"\ncells {options}: float {float_bpc:.4f}, {bpc:.4f} ({delta:+.2%}), {logits_db:.1f} dB")
    assert abs(delta) <= max_delta
    if min_db is not None:
        assert logits_db >= min_db
