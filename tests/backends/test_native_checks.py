"""A crafted argument to a native op is a clean error, never a signal (``native_checks.py``,
``program_checks.py``).

The property: every mutation of a real lowered model's quantree calls (``native_mutations.py``,
run in a worker so that a signal fails the test and names the example) either runs or
raises. ``QUANTREE_NATIVE_EXAMPLES`` (default 150) and ``QUANTREE_NATIVE_SEED`` (default 0)
choose how many and which. Then the cases the property found or the issue named, and a
saved model with one table entry or integer changed in its archive, loaded both ways.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import quantree as qt
from quantree.backends import CPU, save
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.packing import pack

from support import batches

WORKER = Path(__file__).with_name("native_mutations.py")
ops = torch.ops.quantree


def test_mutated_native_calls_run_or_raise_never_signal() -> None:
    examples = int(os.environ.get("QUANTREE_NATIVE_EXAMPLES", "150"))
    seed = int(os.environ.get("QUANTREE_NATIVE_SEED", "0"))
    done = subprocess.run(
        [sys.executable, str(WORKER), str(examples), str(seed)],
        capture_output=True,
        text=True,
        timeout=max(900, 3 * examples),
    )
    lines = done.stdout.splitlines()
    tried = [line for line in lines if line.startswith("{")]
    passed = [line for line in lines if line.startswith("ok ")]
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise AssertionError(f"worker killed by {name} (seed {seed}) on {tried[-1:]}")
    assert done.returncode == 0, f"seed {seed}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert passed and len(passed) == len(tried) <= examples, done.stdout[-2000:]
    # every refusal is a QuantreeError (NativeArgumentError), never a raw Python error
    raw = [(t, p) for t, p in zip(tried, passed, strict=True) if p.startswith("ok raw")]
    assert raw == [], raw[:5]
    # the mutations reach the checks, and legit-looking ones still run
    assert any("NativeArgumentError" in line for line in passed)
    assert any(line == "ok ran" for line in passed)


def test_the_reported_program_is_refused() -> None:
    x, slots = torch.zeros(1, 4), torch.tensor([[0, 0, 0, 4, 4, 1]])
    with pytest.raises(NativeArgumentError, match=r"quantree\.program: input slot 1000000"):
        ops.program(
            [x], [], torch.zeros(0, 12, dtype=torch.int64), torch.zeros(0, 8), slots,
            torch.tensor([10**6]), torch.tensor([0]), [1, 4], [2], [1, 4], [2], [0],
        )  # fmt: skip


def _copy_program(slots: list[list[int]], code: list[list[int]]) -> list[torch.Tensor]:
    """A one-instruction program copying a [rows, 4] float input to the output."""
    x = torch.arange(8.0).reshape(2, 4)
    return ops.program(
        [x], [], torch.tensor(code, dtype=torch.int64), torch.zeros(len(code), 8),
        torch.tensor(slots, dtype=torch.int64), torch.tensor([0]), torch.tensor([1]),
        [2, 4], [2], [2, 4], [2], [0],
    )  # fmt: skip


def test_program_views_must_stay_inside_their_owner() -> None:
    copy = [[5, 1, 0] + [0] * 9]
    owner = [0, 0, 0, 4, 4, 2]
    (out,) = _copy_program([owner, [0, 1, 0, 4, 4, 2]], copy)  # legit: runs
    assert torch.equal(out, torch.arange(8.0).reshape(2, 4))
    cases = {
        "past the storage": [owner, owner, [0, 0, 8, 4, 4, 2]],  # offset 8 bytes, 2 rows
        "no earlier owner": [owner, [0, 2, 0, 4, 4, 2], [0, 2, 0, 4, 4, 2]],
        "negative size or offset": [owner, [0, 1, 0, 4, 4, 2], [0, 0, -4, 4, 4, 1]],
    }
    for why, slots in cases.items():
        with pytest.raises(NativeArgumentError, match=why):
            _copy_program(slots, [[5, 1, 2] + [0] * 9] if len(slots) > 2 else copy)


def test_dynamic_views_are_checked_for_every_size() -> None:
    """A view whose offset grows faster with the size symbol than its owner's rows is
    inside at s = 0 and outside for larger s: refused whatever this call's s."""
    x = torch.zeros(1, 4)
    code = torch.tensor([[5, 1, 2] + [0] * 9], dtype=torch.int64)
    # fields: dtype, owner, offset, cols, ld, rows, rows coefficient, offset coefficient
    slots = [[0, 0, 0, 4, 4, 0, 1, 0], [0, 1, 0, 4, 4, 0, 1, 0], [0, 0, 0, 4, 4, 0, 1, 32]]
    with pytest.raises(NativeArgumentError, match="past the storage"):
        ops.program(
            [x], [], code, torch.zeros(1, 8), torch.tensor(slots), torch.tensor([0]),
            torch.tensor([1]), [0, 4], [2], [0, 4], [2], [0], [1, 0], [1, 0], [0, 0, 0, 1],
        )  # fmt: skip


def test_layer_constants_are_checked() -> None:
    weight = pack(torch.ones(8, 16, dtype=torch.int8))
    x = torch.zeros(2, 16, dtype=torch.int8)
    offset, scale = torch.zeros(8, dtype=torch.int32), torch.ones(8)
    assert ops.linear(x, weight, offset, scale, None, 8, 0.1, 0, False).shape == (2, 8)
    with pytest.raises(NativeArgumentError, match=r"weight .* holds 16 channels"):
        ops.linear(x, weight, offset, scale, None, 4096, 0.1, 0, False)
    with pytest.raises(NativeArgumentError, match=r"x is torch.float32"):
        ops.linear(x.float(), weight, offset, scale, None, 8, 0.1, 0, False)
    with pytest.raises(NativeArgumentError, match=r"offset is torch.float32"):
        ops.linear(x, weight, offset.float(), scale, None, 8, 0.1, 0, False)
    with pytest.raises(NativeArgumentError, match=r"table is torch.int8 with 255"):
        ops.lookup(x, torch.zeros(255, dtype=torch.int8))
    with pytest.raises(NativeArgumentError, match="stride"):
        ops.max_pool2d(torch.zeros(1, 2, 4, 4, dtype=torch.int8), [2, 2], [0, 2], [0, 0],
                       [1, 1], False)  # fmt: skip


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    data = batches((3, 6), n=4)
    low = qt.quantize(Small().eval(), data[0], data, backend=CPU, progress=False)
    path = tmp_path_factory.mktemp("crafted") / "low.pt2"
    save(low, path, data[0])
    return path, data[0][0]


def _rewrite(source: Path, target: Path, edit) -> Path:
    """``source`` with its graph description (``models/model.json``) edited by ``edit``."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("models/model.json"):
                program = json.loads(data)
                edit(program["graph_module"]["graph"])
                data = json.dumps(program).encode()
            dst.writestr(info.filename, data)
    return target


def _out_features(graph: dict) -> None:
    """The first linear told its weight has 1M output channels (it has 8)."""
    node = next(n for n in graph["nodes"] if n["target"].endswith("quantree.linear.default"))
    arg = next(i for i in node["inputs"] if i["name"] == "out_features")
    arg["arg"] = {"as_int": 1 << 20}


LOADERS = {
    "quantree.backends.load": "from quantree.backends import load; m = load(path)",
    "torch.export.load": "import quantree.backends; m = torch.export.load(path).module()",
}


@pytest.mark.parametrize("loader", LOADERS)
def test_a_crafted_saved_model_is_a_clean_error(saved, tmp_path, loader) -> None:
    source, _ = saved
    path = _rewrite(source, tmp_path / "crafted.pt2", _out_features)
    script = (
        f"import sys, torch; path = sys.argv[1]\n{LOADERS[loader]}\n"
        "try:\n    m(torch.zeros(3, 6))\nexcept Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{loader}: status {done.returncode}\n{done.stderr[-2000:]}"
    assert "NativeArgumentError quantree.linear: weight" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def saved_program(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A saved layer-normed LSTM (one region program) whose slot table was crafted before
    saving (the file stores tables narrowed and pooled, so its bytes are not edited in
    place): the last slot's columns say a row far wider than its storage."""
    from test_program import NormedLSTM, _data

    torch.manual_seed(0)
    data = _data()
    low = qt.lower(
        qt.quantize(NormedLSTM().eval(), data[0], data, progress=False, backend="reference"), CPU
    )
    (node,) = [n for n in low.graph.nodes if "quantree.program" in str(n.target)]
    crafted = getattr(low, node.args[4].target).clone()
    crafted[-1, 3] = 1 << 20
    setattr(low, node.args[4].target, crafted)
    path = tmp_path_factory.mktemp("crafted_program") / "crafted.pt2"
    save(low, path, data[0])
    return path, crafted


def test_a_crafted_program_table_is_refused_when_the_file_loads(saved_program, tmp_path) -> None:
    from quantree.backends import load
    from quantree.tools.files import BadFile

    path, _ = saved_program
    with pytest.raises(BadFile, match=r"quantree\.program: slot \d+ reaches past") as caught:
        load(path)
    assert str(caught.value).startswith(str(path))
    script = (
        "import sys, torch, quantree.backends\n"
        "m = torch.export.load(sys.argv[1]).module()\n"
        "try:\n    m(torch.zeros(6, 2, 12))\nexcept Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"status {done.returncode}\n{done.stderr[-2000:]}"
    assert "NativeArgumentError quantree.program: slot" in done.stdout, done.stdout


def test_empty_products_are_empty_not_errors() -> None:
    """A zero-size M, K or N (an empty sequence in attention) is a legal input."""
    a, b = torch.zeros(2, 3, 0, dtype=torch.int8), torch.zeros(2, 0, 4, dtype=torch.int8)
    assert ops.matmul(a, b, 0.1, 0, 0.1, 0, 0.1, 0).shape == (2, 3, 4)
    empty = ops.matmul(b.transpose(1, 2), a.transpose(1, 2), 0.1, 0, 0.1, 0, 0.0, 0)
    assert empty.shape == (2, 4, 3) and not empty.any()
    rows = torch.zeros(2, 0, 5, dtype=torch.int8), torch.zeros(2, 5, 4, dtype=torch.int8)
    assert ops.matmul(*rows, 0.1, 0, 0.1, 0, 0.1, 0).shape == (2, 0, 4)
    weight = pack(torch.ones(8, 16, dtype=torch.int8))
    x = torch.zeros(0, 3, 16, dtype=torch.int8)
    offset, scale = torch.zeros(8, dtype=torch.int32), torch.ones(8)
    assert ops.linear(x, weight, offset, scale, None, 8, 0.1, 0, False).shape == (0, 3, 8)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_empty_sums_on_every_path_never_signal(isa: str) -> None:
    """K = 0 (an empty sum) on a path other than this machine's: the AVX2 path sized its
    row panels by K and divided by zero (SIGFPE) before the wrappers took K = 0 themselves."""
    script = (
        "import torch\n"
        "from quantree.backends.cpu import ops\n"
        "from quantree.backends.cpu.native.packing import pack\n"
        "w, x = pack(torch.ones(8, 0, dtype=torch.int8)), torch.zeros(4, 0, dtype=torch.int8)\n"
        "off, sc = torch.full((8,), 3, dtype=torch.int32), torch.ones(8)\n"
        "print(ops.linear(x, w, off, sc, None, 8, 0.0, 0, False).tolist()[0][0])\n"
        "a, b = torch.zeros(2, 3, 0, dtype=torch.int8), torch.zeros(2, 0, 4, dtype=torch.int8)\n"
        "print(ops.matmul(a, b, 0.1, 0, 0.1, 0, 0.1, 5).unique().tolist())\n"
    )
    env = {**os.environ, "QUANTREE_CPU_ISA": isa}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{isa}: status {done.returncode}\n{done.stderr[-2000:]}"
    assert done.stdout.split() == ["3.0", "[5]"]
