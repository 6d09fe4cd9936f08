"""One memory budget for everything a load allocates (``backends/cpu/saved/checks/load_budget.py``).

A 5 KB file made c04c399 allocate 2.9-3.4 GB: three ``filled`` recipes of 1 GiB each (each
under ``filled``'s own cap), or a tensor record of 0 bytes whose metadata claims 2.5 GB.
Each crafted file is loaded in a subprocess under a 2 GiB address-space limit (an honest
load of these models peaks near 0.7 GiB), where it must be a ``BadFile`` naming the budget
or the record, not a failed allocation.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crafted_programs import edit_json, rewrite
from torch import nn

import quantree as qt

from support import batches

MODEL = "models/model.json"
LIMIT = 2 << 30


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


@pytest.fixture(scope="module")
def lowered_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantree.backends import CPU, save

    torch.manual_seed(0)
    data = batches((3, 64), n=4)
    low = qt.quantize(Twice().eval(), data[0], data, backend=CPU, progress=False)
    path = tmp_path_factory.mktemp("budget") / "low.pt2"
    save(low, path, data[0])
    return path


def _load_limited(path: Path) -> str:
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))\n"
        "from quantree.backends import load\nfrom quantree.tools.files import BadFile\n"
        "try:\n    load(sys.argv[1])\n    print('loaded')\n"
        "except BadFile as e:\n    print('BadFile', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def _three_gib_filled(program: dict) -> None:
    nodes = program["graph_module"]["graph"]["nodes"]
    recipes = [n for n in nodes if "quantree.derived" in n["target"] or "widened" in n["target"]]
    assert len(recipes) >= 3
    for node in recipes[:3]:
        node["target"] = "torch.ops.quantree.filled.default"
        node["inputs"] = [
            {"name": "value", "arg": {"as_float": 1.0}, "kind": 1},
            {"name": "size", "arg": {"as_ints": [1 << 28]}, "kind": 1},
            {"name": "dtype", "arg": {"as_scalar_type": 7}, "kind": 1},  # float32: 1 GiB
        ]


def test_three_filled_gibibytes_are_refused_before_allocating(lowered_file, tmp_path) -> None:
    path = rewrite(lowered_file, tmp_path / "filled.pt2", edit_json(MODEL, _three_gib_filled))
    assert path.stat().st_size < 64 << 10
    out = _load_limited(path)
    assert out.startswith(f"BadFile {path}:") and "load budget" in out, out
    assert "quantree.filled" in out and "QUANTREE_LOAD_BUDGET" in out, out


def _claims_gigabytes(name: str, data: bytes) -> bytes | None:
    """The first weight's metadata says 2.5 G int8 elements; its record is emptied."""
    import json

    if name.endswith("_weights_config.json"):
        config = json.loads(data)
        entry = next(iter(config["config"].values()))
        entry["tensor_meta"]["sizes"] = [{"as_int": 2_500_000_000}]
        entry["tensor_meta"]["strides"] = [{"as_int": 1}]
        entry["tensor_meta"]["dtype"] = 2
        _claims_gigabytes.record = "data/weights/" + entry["path_name"]  # type: ignore[attr-defined]
        return json.dumps(config).encode()
    return data


def test_a_record_smaller_than_its_tensor_is_refused(lowered_file, tmp_path) -> None:
    path = rewrite(lowered_file, tmp_path / "claims.pt2", _claims_gigabytes)
    record = _claims_gigabytes.record  # type: ignore[attr-defined]
    path = rewrite(path, tmp_path / "empty.pt2", lambda n, d: b"" if n == record else d)
    out = _load_limited(path)
    assert out.startswith(f"BadFile {path}:") and "reaching byte 2500000000" in out, out
