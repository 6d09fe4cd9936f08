"""No C++ exception crosses the kernels' ``extern "C"`` (``QT_CATCH``), table entries larger
than a program needs are refused before the kernel allocates, and the cache of a library
built for this CPU (``-march=native``) is not shared with another CPU.

The memory cases run in a child process whose address space is capped at what it maps
plus 2 GiB: there a ``std::bad_alloc`` through ``extern "C"`` kills the process (SIGABRT),
and nothing of the machine's memory is at stake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quantree.backends.cpu.cells import runner as cell_runner
from quantree.backends.cpu.native import build as build_native
from quantree.backends.cpu.native import loader as native
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.ops import OPS, elementwise

SRC = str(Path(native.__file__).resolve().parents[4])
ENTRY_POINTS = {s for m in (*OPS, cell_runner) for s in vars(m).get("SIGNATURES", {})}
"""Every C entry point an op module declares (``ops.OPS``; the cell loops' in ``cells/``)."""

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from quantree.backends.cpu.native.loader import library
    import quantree.backends  # the ops
    library()
    size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), size + (2 << 30)))
    ld, cols, op = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    try:
        if op == "cell_loop":
            slots = torch.tensor([[0, 0, 0, 4, 4], [0, 1, 0, 4, 4], [0, 2, 0, cols, ld]])
            torch.ops.quantree.cell_loop(
                torch.zeros(1, 1, 4), [torch.zeros(1, 4)], [],
                torch.zeros(0, 12, dtype=torch.int64), torch.zeros(0, 8), slots,
                torch.tensor([1]), False,
            )
        else:  # a region program copying its [2, 4] input into an output slot of stride ld
            slots = torch.tensor([[0, 0, 0, 4, 4, 2], [0, 1, 0, cols, ld, 2]])
            torch.ops.quantree.program(
                [torch.zeros(2, 4)], [], torch.tensor([[5, 1, 0] + [0] * 9]), torch.zeros(1, 8),
                slots, torch.tensor([0]), torch.tensor([1]), [2, 4], [2], [2, 4], [2], [0],
            )
        print(json.dumps(["ran", ""]))
    except Exception as error:
        print(json.dumps([type(error).__name__, str(error)[:400]]))
    """
)


def child(ld: int, cols: int, op: str = "cell_loop", **env: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ld), str(cols), op],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    )
    assert done.returncode == 0, f"child died ({done.returncode}): {done.stderr[-2000:]}"
    kind, message = json.loads(done.stdout.strip().splitlines()[-1])
    return kind, message


def test_a_row_stride_of_2_31_is_refused_before_the_kernel() -> None:
    kind, message = child((1 << 31) - 1, 4)
    assert kind == "NativeArgumentError"
    assert "slot 2 owns its storage with a row stride of 2147483647 for 4 columns" in message
    kind, message = child((1 << 31) - 1, 4, "program")
    assert kind == "NativeArgumentError"
    assert "quantree.program: slot 1 owns its storage with a row stride of 2147483647" in message


def test_a_width_the_program_does_not_need_is_refused_before_the_kernel() -> None:
    kind, message = child((1 << 31) - 1, (1 << 31) - 1)
    assert kind == "NativeArgumentError"
    assert "is larger than the program needs" in message
    assert "QUANTREE_NATIVE_WORKSPACE_FACTOR" in message


def test_an_allocation_failing_inside_the_kernel_is_a_python_memory_error() -> None:
    """Following the message's fix (a larger factor) lets the kernel try; its
    ``std::bad_alloc`` under the cap comes back as a ``MemoryError``, not SIGABRT."""
    big = 1 << 30  # a 4 GiB workspace: more than the child may map
    kind, message = child(big, big, QUANTREE_NATIVE_WORKSPACE_FACTOR="1e12")
    assert kind == "NativeMemoryError", message
    assert "qt_cell_loop could not allocate its workspace" in message


def test_every_entry_point_reports_what_its_cxx_threw() -> None:
    lib = native.library()
    lib.qt_guard_probe(0)
    with pytest.raises(MemoryError, match="qt_guard_probe could not allocate"):
        lib.qt_guard_probe(1)
    with pytest.raises(NativeArgumentError, match="C\\+\\+ exception"):
        lib.qt_guard_probe(2)
    lib.qt_guard_probe(0)  # the error was taken: the next call is clean
    x, out = torch.randn(8), torch.empty(8, dtype=torch.int8)
    elementwise.kernels().qt_quantize(x.data_ptr(), 8, 10.0, 0.0, out.data_ptr())
    assert torch.equal(out, torch.ops.quantree.quantize(x, 0.1, 0))


def test_every_entry_point_is_guarded() -> None:
    """Each ``void qt_*`` definition in the sources ends in ``QT_CATCH``."""
    unguarded, found = [], set()
    for path in sorted(build_native.CSRC.glob("*.cpp")):
        text = path.read_text()
        for name in (*sorted(ENTRY_POINTS), "qt_guard_probe"):
            start = text.find(f"void {name}(")
            if start < 0:
                continue
            brace, semicolon = text.find("{", start), text.find(";", start)
            if semicolon < brace:  # a declaration
                continue
            if not text[start:brace].rstrip().endswith("try"):
                unguarded.append(f"{path.name}: {name}")
            found.add(name)
    assert unguarded == []
    assert len(found) >= 25  # every void entry point was looked at


def fake_compiler(tmp_path: Path) -> str:
    """A compiler whose ``-march=native`` predefines AVX-512 or AVX2 macros, as on two
    hosts sharing one cache, by ``$FAKE_HOST``."""
    script = tmp_path / "fake-c++"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$FAKE_HOST" = avx512 ]; then echo "#define __AVX512F__ 1"; fi\n'
        'echo "#define __AVX2__ 1"\n'
    )
    script.chmod(0o755)
    return str(script)


def test_the_cache_key_names_the_instruction_set_native_means(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = fake_compiler(tmp_path)
    monkeypatch.setattr(native, "MARCH", "native")
    keys = {}
    for host in ("avx512", "avx2"):
        monkeypatch.setenv("FAKE_HOST", host)
        build_native.march_meaning.cache_clear()
        keys[host] = native.source_digest(compiler)
    build_native.march_meaning.cache_clear()
    assert keys["avx512"] != keys["avx2"]
    # and the same host finds its own library again
    monkeypatch.setenv("FAKE_HOST", "avx2")
    assert native.source_digest(compiler) == keys["avx2"]
    build_native.march_meaning.cache_clear()
