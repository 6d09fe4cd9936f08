"""Property-based tests: random models through capture, prepare, calibrate, convert and lower.

Random DAGs (``random_graphs.py``: conv1d/2d with groups (depthwise, narrow), strides,
dilation and padding modes, transposed convs, pooling, upsampling, batch/layer/group norm,
activations, softmax, scalar arithmetic, residual add/mul, cat/stack/split/chunk, matmul/bmm,
SDPA, nn.MultiheadAttention and TransformerEncoderLayer with bool/-inf/causal masks,
embedding, LSTM/GRU/RNN with layers, directions, projections, packed sequences and given
states, cell loops, in-place ops, shared modules), every observer kind, whole and cells mode,
the model in train mode or not, data contiguous or strided, a short last batch. Properties,
per example (``random_models.py`` states each bound and why):

- capture .. lower all succeed, or raise a ``QuantreeError`` (anything else fails);
- the user's model is unchanged (parameters bit-equal, training modes);
- prepared within 1e-4 of float; every float output of the lowered model within 20 dB SQNR
  of the reference (10 dB for whole-mode recurrent layers on moving-average ranges), the
  reference not noisier than float's signal (0 dB); near-zero outputs compared absolutely;
- every op the lowered model computes in float is named by a lowering warning;
- ``backends.save``/``load`` bit-equal to the lowered model; ``quantree inspect`` reads it;
- without recurrent layers another batch size runs or raises a ``QuantreeError``.

The examples run in a worker process, so a native crash (a signal) fails the test and names
the example it died on. ``QUANTREE_RANDOM_EXAMPLES`` (default 6, for CI) and
``QUANTREE_RANDOM_SEED`` (default 0) choose how many and which.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("random_models.py")


def test_random_nested_models_hold_every_property():
    examples = int(os.environ.get("QUANTREE_RANDOM_EXAMPLES", "6"))
    seed = int(os.environ.get("QUANTREE_RANDOM_SEED", "0"))
    done = subprocess.run(
        [sys.executable, str(WORKER), str(examples), str(seed)],
        capture_output=True,
        text=True,
        timeout=max(600, 30 * examples),
    )
    lines = done.stdout.splitlines()
    tried = [line for line in lines if line.startswith("{")]
    passed = [line for line in lines if line.startswith(("ok ", "refused "))]
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise AssertionError(
            f"worker killed by {name} (hypothesis seed {seed}) on example {tried[-1:]}"
        )
    assert done.returncode == 0, (
        f"hypothesis seed {seed}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    assert passed and len(passed) == len(tried) <= examples, done.stdout[-2000:]
