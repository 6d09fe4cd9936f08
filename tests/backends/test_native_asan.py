"""The native scenarios under AddressSanitizer: no kernel reads or writes outside its buffers.

The kernels are built with ``QUANTREE_NATIVE_SANITIZE=address`` (``-fsanitize=address``,
a library of its own in the cache) and run in a child Python with libasan preloaded, which
reports the first bad access (a heap overflow, a use after free) and exits non-zero. The run
is opt-in, ``QUANTREE_ASAN=1``: building the sanitized library from a cold cache takes
minutes, more than the CI budget leaves. What runs then: the strided-argument cases
(``test_native_args``: the copies a kernel reads must outlive its call), two of the
nested-structure scenarios (``test_cpu_scenarios``: an LSTM with three heads,
chunk/split/max-pool) and 40 mutated native calls (``native_mutations.py``).
``QUANTREE_ASAN_FULL=1`` runs every scenario of ``test_cpu_scenarios.py``,
``test_native_checks.py`` (its 150 mutations and the crafted saved models) and 400 mutations.

Skipped, saying why, where the compiler has no libasan.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantree.backends.cpu.native import loader as native

HERE = Path(__file__).resolve().parent
SRC = str(Path(native.__file__).resolve().parents[4])
FULL = os.environ.get("QUANTREE_ASAN_FULL", "") == "1"


def runtime(name: str) -> str | None:
    """The compiler's ``name`` library, if it has one."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None
    done = subprocess.run(
        [compiler, f"-print-file-name={name}"], capture_output=True, text=True, check=False
    )
    path = done.stdout.strip()
    return path if done.returncode == 0 and os.path.isabs(path) and Path(path).exists() else None


LIBASAN = runtime("libasan.so")
LIBSTDCXX = runtime("libstdc++.so")
"""Preloaded after libasan: its ``__cxa_throw`` interceptor needs the C++ runtime loaded
when it starts (Python is C; torch's exceptions otherwise stop ASan on a failed CHECK)."""
pytestmark = [
    pytest.mark.skipif(LIBASAN is None, reason="the C++ compiler has no libasan.so"),
    pytest.mark.skipif(
        os.environ.get("QUANTREE_ASAN", "") != "1" and not FULL,
        reason="opt-in: QUANTREE_ASAN=1 (or QUANTREE_ASAN_FULL=1) builds the sanitized kernels",
    ),
]


def under_asan(args: list[str], timeout: int, logs: Path) -> subprocess.CompletedProcess[str]:
    """``python args`` with the AddressSanitizer kernels and libasan preloaded; its reports
    are written to ``logs`` (a test runner in the child captures its stderr)."""
    options = f"detect_leaks=0:alloc_dealloc_mismatch=0:halt_on_error=1:log_path={logs}/asan"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([SRC, str(HERE), str(HERE.parent)]),
        "QUANTREE_NATIVE_SANITIZE": "address",
        "LD_PRELOAD": os.pathsep.join(p for p in (LIBASAN, LIBSTDCXX) if p),
        # Python and torch are not instrumented: their own allocations are not ours to judge
        "ASAN_OPTIONS": options,
    }
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
        cwd=HERE,
    )  # fmt: skip


def clean(done: subprocess.CompletedProcess[str], logs: Path) -> None:
    reports = [path.read_text() for path in sorted(logs.glob("asan*"))]
    assert reports == [], reports[0][:6000]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_native_scenarios_are_clean_under_asan(tmp_path: Path) -> None:
    files = ["test_native_args.py", "test_cpu_scenarios.py"]
    if FULL:
        files.append("test_native_checks.py")
    select = [] if FULL else ["-k", "not scenarios_lower or LstmThreeHeads or ChunkSplitMaxPool"]
    if not FULL:
        files[1] += "::test_nested_scenarios_lower"
    done = under_asan(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files, *select],
                      3600, tmp_path)  # fmt: skip
    clean(done, tmp_path)
    assert " passed" in done.stdout.splitlines()[-1], done.stdout[-2000:]


def test_mutated_native_calls_are_clean_under_asan(tmp_path: Path) -> None:
    """The mutations, in a child that first says which library it loaded (the sanitized
    one: a library of its own in the cache)."""
    examples = 400 if FULL else 40
    code = (
        "from quantree.backends.cpu.native.loader import library_path; print(library_path()); "
        f"import native_mutations; native_mutations.main({examples}, 0)"
    )
    done = under_asan(["-c", code], 3600, tmp_path)
    clean(done, tmp_path)
    assert "quantree_cpu_kernels_address" in done.stdout.splitlines()[0], done.stdout[:500]
    outcomes = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(outcomes) == examples
