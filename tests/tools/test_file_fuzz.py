"""The saved-file fuzzer (``file_fuzz.py``) in CI: 300 mutations of a saved lowered model.

Each mutant is loaded and called in a forked child under an address-space limit of twice
the honest load's peak and 10 s of CPU time; the fuzzer prints one JSON line per finding
(a signal, a hang, a failed allocation, an exception other than ``QuantreeError``, a file
written, raw byte damage loading as another model) and a summary. The runs are
subprocesses, so a crash in the fuzzer itself cannot take the suite down.

The 300 are three test cases of 100 mutations (seeds ``SEED``, ``SEED + 1``, ``SEED + 2``),
the third on the model whose loop is folded into one native program (``program_loop``),
so that each stays well under a minute on a loaded machine.
``QUANTREE_FUZZ_COUNT`` (mutations per case) and ``QUANTREE_FUZZ_SEED`` choose the run; the
seed's default changes only by hand, so CI runs the same mutations every time, and a
finding prints its seed and index: ``python file_fuzz.py N SEED DIR INDEX`` replays it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COUNT = int(os.environ.get("QUANTREE_FUZZ_COUNT", "100"))
SEED = int(os.environ.get("QUANTREE_FUZZ_SEED", "22"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")  # the saved model is built once, by the first case


@pytest.mark.parametrize(("offset", "model"), [(0, "cells"), (1, "cells"), (2, "folded")])
def test_mutated_saved_files_are_refused_or_equal_never_a_crash(workdir, offset, model) -> None:
    runner = Path(__file__).with_name("file_fuzz.py")
    done = subprocess.run(
        [sys.executable, str(runner), str(COUNT), str(SEED + offset), str(workdir)],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "QUANTREE_FUZZ_MODEL": model},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary, findings = lines[-1], lines[:-1]
    assert summary["count"] == COUNT and summary["findings"] == len(findings)
    assert findings == [], findings[:5]
    assert sum(summary["outcomes"].values()) == COUNT
    assert summary["outcomes"].get("refused", 0) > 0 and summary["outcomes"].get("equal", 0) > 0
