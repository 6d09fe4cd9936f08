"""A fuzzer of saved files, kept: mutate a saved lowered model, load and call each mutant.

``python file_fuzz.py COUNT SEED [WORKDIR [N,N...]]`` (the last replays those mutations
only: a finding prints its seed and index; ``QUANTREE_FUZZ_MODEL=folded`` takes ``Folded``,
whose loop is folded into one native program) saves one small lowered model (a layer-normed
recurrence that lowers to a region program, a cells-mode LSTM that lowers to a native cell
loop, recipes, narrowed and pooled constants), then for each of COUNT mutations writes the
mutant and forks a child that loads it with ``quantree.backends.load`` and calls it under
an address-space limit of twice the honest load's peak and 10 s of CPU time, in an empty
working directory. A mutation edits the graph description (a value, a node's op, a deleted
or duplicated entry, a symbolic shape, deep nesting), a payload config's tensor metadata,
the zip's members (dropped, added, deflated) or raw bytes anywhere (checksums left stale).

Each child reports one outcome: ``refused`` (``QuantreeError``, ``BadFile`` among them, at
load), ``call-refused`` (``QuantreeError`` at the call), ``equal`` (the original's output),
``another-model`` (a well-formed program computing something else: a changed constant or a
swapped op of the dialect, written with valid checksums). Findings: a signal, a hang, a
``MemoryError`` or failed allocation, any other exception, a file written in the working
directory or the canary file changed, and ``another-model`` from raw byte damage (checksums
stale: that must be refused or equal). Prints one JSON line per finding and a summary line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

HANG_SECONDS = 10
"""CPU seconds a child may use (``RLIMIT_CPU``: a loaded shared machine stretches wall time)."""
WALL_SECONDS = 120
"""Wall seconds after which a child that is not using CPU (blocked) is killed as a hang."""
CANARY = b"canary"
NASTY_TARGETS = [
    "torch.ops.aten.from_file.default", "torch.ops.aten.copy_.default", "torch.save",
    "torch.load", "torch.os.system", "_operator.call", "builtins.eval", "math.factorial",
    "torch.ops.aten.rand.default", "torch.ops.aten.as_strided.default",
    "torch.ops.aten.empty_strided.default", "torch.ops.aten.set_.source_Tensor",
    "torch.ops.aten.resize_.default", "torch.ops.higher_order.cond",
    "torch.ops.c10d_functional.all_reduce.default", "torch.ops.aten._local_scalar_dense.default",
    "torch.ops.aten.add_.Tensor", "torch.ops.aten.relu_.default", "#custom:op",
    "torch.ops.quantree.filled.default", "torch.ops.quantree.program.default",
    "torch.ops.quantree.cell_loop.default", "torch.ops.aten.full.default",
]  # fmt: skip
NASTY_EXPRESSIONS = [
    "s0 + 0*9**9**9", "PowByNatural(9, PowByNatural(9, 9))", "LShift(1, 10**9)",
    "__import__('os').system('true')", "Max(" * 200 + "s0" + ")" * 200, "s77*99999999999",
    "Symbol('s77') + 2**62", "-1", "0", "FloorDiv(s77, 0)", "Mod(s77, 0)",
]  # fmt: skip
NASTY_INTS = [0, -1, 1, 2, 3, 7, 255, 2**15, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]
NASTY_FLOATS = [0.0, -0.0, 1e-45, 1e38, -1e38, float("inf"), float("nan"), 1.0]


class Model(nn.Module):
    """A layer-normed recurrence (a region program) feeding a cells-mode LSTM (a native
    cell loop) and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.x2g, self.p2g = nn.Linear(6, 16), nn.Linear(4, 16, bias=False)
        self.norm = nn.LayerNorm(16)
        self.lstm, self.fc = nn.LSTM(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, B, 6]
        h = c = x.new_zeros(x.shape[1], 4)
        outs = []
        for g in self.x2g(x).unbind(0):
            i, f, z, o = self.norm(g + self.p2g(h)).sigmoid().chunk(4, 1)
            c = f * c + i * z
            h = o * c.tanh()
            outs.append(h)
        return self.fc(self.lstm(torch.stack(outs, 0))[0])


class Folded(nn.Module):
    """A gated recurrence over a Python loop (a Light-GRU's step), folded into one native
    program run for every step, feeding a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.u = nn.Linear(6, 16, bias=False), nn.Linear(8, 16, bias=False)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, B, 6]
        wx, h, ys = self.w(x), x.new_zeros(x.shape[1], 8), []
        for t in range(x.shape[0]):
            a, z = (wx[t] + self.u(h)).chunk(2, dim=-1)
            z = torch.sigmoid(z)
            h = z * h + (1 - z) * torch.relu(a)
            ys.append(h)
        return self.fc(torch.stack(ys, 0))


def build(root: Path, folded: bool = False) -> tuple[Path, tuple[torch.Tensor, ...]]:
    """The saved model; ``folded`` folds its Python loop into one native program run for
    every step (``quantree.program_loop``: tables, per-step roles and fed states in the file)."""
    import warnings

    import quantree as qt
    from quantree.backends import CPU, save

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(9 if folded else 4, 2, 6, generator=g),) for _ in range(4)]
    path = root / ("folded.pt2" if folded else "model.pt2")
    if path.exists():  # built by an earlier run in this directory
        return path, data[0]
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)  # the folded loop's one warning
        model = Folded() if folded else Model()
        low = qt.quantize(model.eval(), data[0], data, quantizer=quantizer, backend=CPU,
                          progress=False, fold_loops=folded or None)  # fmt: skip
    if folded and not any(type(m).__name__ == "NativeProgramLoop" for m in low.modules()):
        raise AssertionError("the folded model's loop did not become one native program")
    save(low, path, data[0])
    return path, data[0]


# ---- mutations ----------------------------------------------------------------------------


def _members(path: Path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i, z.read(i)) for i in z.infolist()]


def _write(members: list[tuple[zipfile.ZipInfo, bytes]], target: Path) -> None:
    with zipfile.ZipFile(target, "w") as z:
        for info, data in members:
            z.writestr(info, data, compress_type=info.compress_type)


def _leaves(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(
            item, list) else ()  # fmt: skip
        for key, child in children:
            out.append((*where, key))
            stack.append((child, (*where, key)))
    return out


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


def _nasty_value(rng: random.Random, old: Any) -> Any:
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice([*NASTY_INTS, old + 1, old - 1, old * 2, -old])
    if isinstance(old, float):
        return rng.choice([*NASTY_FLOATS, old * 2, -old])
    if isinstance(old, str):
        return rng.choice([*NASTY_TARGETS, *NASTY_EXPRESSIONS, "", old + "_", "x" * 1000])
    return rng.choice([None, 0, "", [], {}, [0] * 5])


def _mutate_json(rng: random.Random, doc: Any) -> str:
    """Edit ``doc`` in place; returns what was done."""
    paths = [p for p in _leaves(doc) if p]
    path = rng.choice(paths)
    parent, key = _get(doc, path[:-1]), path[-1]
    old = parent[key]
    action = rng.random()
    if key == "target" and isinstance(old, str) and action < 0.7:
        targets = [_get(doc, p) for p in paths if p[-1] == "target"]
        parent[key] = rng.choice([*NASTY_TARGETS, *targets])
        return f"target {old} -> {parent[key]}"
    if key == "expr_str" and action < 0.7:
        parent[key] = rng.choice(NASTY_EXPRESSIONS)
        return f"expr_str -> {parent[key][:40]}"
    if action < 0.6 or not isinstance(parent, dict | list):
        parent[key] = _nasty_value(rng, old)
        return f"value at {path[-3:]} {str(old)[:30]} -> {str(parent[key])[:30]}"
    if action < 0.75:
        del parent[key]
        return f"deleted {path[-3:]}"
    if action < 0.85 and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(old)))
        return f"duplicated {path[-3:]}"
    if action < 0.92:
        parent[key] = json.loads("[" * 300 + "0" + "]" * 300)
        return f"nested 300 deep at {path[-3:]}"
    parent[key] = [old] * 50 if not isinstance(old, list) else old * 50
    return f"repeated 50x at {path[-3:]}"


def mutate(rng: random.Random, source: Path, target: Path) -> tuple[str, bool]:
    """Write a mutant of ``source`` to ``target``; returns (description, raw damage)."""
    members = _members(source)
    kind = rng.choices(["json", "config", "members", "bytes", "record"], [6, 2, 1, 2, 1])[0]
    if kind in ("json", "config"):
        names = [i for i, (info, _) in enumerate(members) if info.filename.endswith(".json")]
        if kind == "json":
            index = next(i for i in names if members[i][0].filename.endswith("models/model.json"))
        else:
            index = rng.choice([i for i in names if "config" in members[i][0].filename])
        info, data = members[index]
        doc = json.loads(data)
        what = _mutate_json(rng, doc)
        members[index] = (info, json.dumps(doc).encode())
        _write(members, target)
        return f"{info.filename.split('/', 1)[1]}: {what}", False
    if kind == "members":
        action = rng.choice(["drop", "duplicate", "deflate", "bomb", "rename"])
        index = rng.randrange(len(members))
        info, data = members[index]
        if action == "drop":
            del members[index]
        elif action == "duplicate":
            members.append((info, data))
        elif action == "deflate":
            info.compress_type = zipfile.ZIP_DEFLATED
        elif action == "bomb":
            info.compress_type = zipfile.ZIP_DEFLATED
            members[index] = (info, data + b" " * (50 << 20))
        else:
            root = info.filename.split("/", 1)[0]
            info.filename = f"{root}/data/weights/weight_{rng.randrange(100)}"
        with contextlib.suppress(Exception):
            _write(members, target)
            return f"member {info.filename}: {action}", False
        target.write_bytes(source.read_bytes())
        return "unchanged", False
    if kind == "record":  # a tensor's bytes changed, its checksum written anew
        records = [i for i, (info, _) in enumerate(members) if "/data/" in info.filename
                   and not info.filename.endswith((".json", ".pt"))]  # fmt: skip
        index = rng.choice(records)
        info, data = members[index]
        raw = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        members[index] = (info, bytes(raw))
        _write(members, target)
        return f"record {info.filename.split('/', 1)[1]} bytes changed", False
    raw = bytearray(source.read_bytes())
    for _ in range(rng.randint(1, 8)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    target.write_bytes(bytes(raw))
    return "raw bytes changed (checksums stale)", True


# ---- one child per mutant -----------------------------------------------------------------


def child(path: Path, example: tuple[torch.Tensor, ...], expected: torch.Tensor,
          limit: int) -> str:  # fmt: skip
    from quantree.backends import load
    from quantree.core.errors import QuantreeError

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (HANG_SECONDS, HANG_SECONDS + 1))
    try:
        model = load(path)
    except QuantreeError:
        return "refused"
    except MemoryError:
        return "finding: MemoryError at load"
    except Exception as error:
        return f"finding: raw {type(error).__name__} at load: {str(error)[:200]}"
    try:
        out = model(*example)
    except QuantreeError:
        return "call-refused"
    except MemoryError:
        return "finding: MemoryError at call"
    except Exception as error:
        return f"finding: raw {type(error).__name__} at call: {str(error)[:200]}"
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.equal(out, expected):
        return "equal"
    return "another-model"


def run_one(path: Path, example: tuple, expected: torch.Tensor, limit: int, cwd: Path) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        outcome = "finding: no outcome"
        try:
            os.chdir(cwd)
            outcome = child(path, example, expected, limit)
        except BaseException as error:
            outcome = f"finding: {type(error).__name__} {error}"[:300]
        finally:
            os.write(write, outcome.encode()[:4000])
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + WALL_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.01)
    with os.fdopen(read, "rb") as pipe:
        outcome = pipe.read().decode(errors="replace")
    if status == -1:
        return "finding: hang (killed)"
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return f"finding: {'hang' if name == 'SIGXCPU' else 'signal'} {name}"
    return outcome or "finding: child exited without an outcome"


def honest_peak(path: Path, example: tuple) -> tuple[torch.Tensor, int]:
    """The original's output and the peak address space of a child loading and calling it."""
    from quantree.backends import load

    expected = load(path)(*example)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        load(path)(*example)
        status = Path("/proc/self/status").read_text().splitlines()
        peak = next(ln for ln in status if ln.startswith("VmPeak")).split()[1]
        os.write(write, peak.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        return expected, int(pipe.read()) * 1024


def fuzz(count: int, seed: int, root: Path, only: set[int] | None = None,
         folded: bool = False) -> dict[str, Any]:  # fmt: skip
    torch.set_num_threads(1)
    path, example = build(root, folded)
    expected, peak = honest_peak(path, example)
    limit = 2 * peak
    rng = random.Random(seed)
    canary = root / "canary.txt"
    canary.write_bytes(CANARY)
    counts: dict[str, int] = {}
    findings = []
    start = time.monotonic()
    for n in range(count):
        mutant = root / "mutant.pt2"
        what, damaged = mutate(rng, path, mutant)
        if only is not None and n not in only:
            continue
        cwd = Path(tempfile.mkdtemp(dir=root))
        outcome = run_one(mutant, example, expected, limit, cwd)
        if damaged and outcome == "another-model":
            outcome = "finding: raw byte damage loaded as another model"
        if any(cwd.iterdir()):
            outcome = f"finding: wrote {sorted(p.name for p in cwd.iterdir())}"
        if canary.read_bytes() != CANARY:
            outcome = "finding: the canary file changed"
            canary.write_bytes(CANARY)
        key = outcome.split(":")[0] if not outcome.startswith("finding") else "finding"
        counts[key] = counts.get(key, 0) + 1
        if outcome.startswith("finding"):
            finding = {"n": n, "seed": seed, "mutation": what, "outcome": outcome}
            findings.append(finding)
            print(json.dumps(finding), flush=True)
        for leftover in cwd.iterdir():
            leftover.unlink()
        cwd.rmdir()
        if (n + 1) % 250 == 0:
            print(f"# {n + 1} mutations, {counts}, {time.monotonic() - start:.0f} s", flush=True)
    ran = count if only is None else len(only)
    summary = {"count": ran, "seed": seed, "outcomes": counts, "findings": len(findings),
               "limit_bytes": limit, "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    workdir = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp())
    workdir.mkdir(parents=True, exist_ok=True)
    replay = {int(n) for n in sys.argv[4].split(",")} if len(sys.argv) > 4 else None
    fuzz(int(sys.argv[1]), int(sys.argv[2]), workdir, replay,
         os.environ.get("QUANTREE_FUZZ_MODEL") == "folded")  # fmt: skip
