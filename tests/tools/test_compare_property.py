"""Property: on a random model, every compare row is within 0.5 dB of an independent per-op
SQNR (``per_op_reference.py``: a separately written interpreter keeping copies of each op's
output as it is produced), for the reference model and for the CPU-lowered one.

The random models (``tests/end_to_end/random_graphs.py``) hold what real models hold: convs,
norms, attention, LSTM/GRU/RNN stacks (packed, bidirectional, with states), cell loops,
in-place ops, shared modules, nested outputs; whole and cells mode. ``QUANTREE_COMPARE_EXAMPLES``
(default 3, for CI) sets how many are drawn, besides the examples always run: models with
in-place ops (``y.relu_(); y += x``) and with stacked recurrent layers, in both modes.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from per_op_reference import assert_rows_match, float_graph

import quantree as qt
from quantree.backends import CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "end_to_end"))
from random_graphs import RandomGraph, describe, plan

EXAMPLES = int(os.environ.get("QUANTREE_COMPARE_EXAMPLES", "3"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 6), cells=st.booleans())
@example(seed=152, length=6, cells=False)  # in-place ops, a 2-layer recurrent stack
@example(seed=6, length=6, cells=True)  # in-place ops
@example(seed=12, length=6, cells=True)  # a recurrent stack
def test_rows_equal_an_independent_per_op_measurement(seed: int, length: int, cells: bool):
    p = plan(seed, length)
    model = RandomGraph(p).eval()
    g = torch.Generator().manual_seed(seed)
    data = [tuple(s.make(g) for s in p.inputs) for _ in range(3)]
    mode = qt.RecurrentMode.CELLS if cells else qt.RecurrentMode.WHOLE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float fallbacks a random model may need
        try:
            ref = qt.quantize(
                model, data[0], data, quantizer=qt.Int8Quantizer(recurrent=mode),
                backend=qt.REFERENCE, progress=False,
            )  # fmt: skip
            low = qt.lower(ref, CPU)
        except qt.QuantreeError:
            assume(False)  # refused with a stated reason: not what this property is about
            return
    float_gm = float_graph(model, data[0])
    models = [("reference", ref)]
    try:
        with torch.no_grad():
            low(*data[0])
        models.append(("cpu", low))
    except qt.QuantreeError:
        pass  # the lowered model itself refuses these inputs: compare has nothing to read
    for name, quantized in models:
        comparison = qt.compare(model, quantized, data[:2])
        try:
            assert_rows_match(comparison, float_gm, quantized, data[:2])
        except AssertionError as e:
            raise AssertionError(f"{name}, {mode.value}:\n{describe(p)}\n{e}") from None
