"""Property-based tests: random nested models through prepare, calibrate, convert and lower.

Random models (``random_models.py``: conv1d with optional batch norm, LSTM/GRU/RNN with
random layers, direction, layout, bias, projection and initial state, then split / chunk /
unbind / max.dim / max_pool with indices / cat / stack / linear, returned in a tuple, list or
dict), every observer kind, whole and cells mode. Properties, per example:

- prepared == float bit for bit; with batch norm folded within ``FOLD_TOLERANCE`` (1e-5) of
  each output's largest magnitude; in cells mode within 1e-5 of max(1, that magnitude);
- convert and CPU lowering run, same output structure, shapes and dtypes;
- every float output leaf of the lowered model within 20 dB SQNR of the reference.

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
    passed = [line for line in lines if line.startswith("ok ")]
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise AssertionError(
            f"worker killed by {name} (hypothesis seed {seed}) on example {tried[-1:]}"
        )
    assert done.returncode == 0, (
        f"hypothesis seed {seed}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    assert passed and len(passed) == len(tried) <= examples, done.stdout[-2000:]
