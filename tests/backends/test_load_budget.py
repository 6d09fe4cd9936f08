"""One memory budget for a load (``backends/cpu/saved/checks/load_budget.py``): the fix its error
names, followed, loads the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends.cpu.saved.checks.load_budget import (
    ENV,
    LoadBudget,
    LoadBudgetExceeded,
    parse_size,
)
from quantree.tools.files import BadFile

from support import batches


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantree.backends import CPU, save

    torch.manual_seed(0)
    data = batches((3, 16), n=4)
    low = qt.quantize(nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval(), data[0], data,
                      backend=CPU, progress=False)  # fmt: skip
    path = tmp_path_factory.mktemp("budget") / "low.pt2"
    save(low, path, data[0])
    return path


def test_the_budget_the_error_names_is_the_fix(saved: Path, monkeypatch) -> None:
    """A budget too small for an honest file says how to raise it; doing so loads it."""
    from quantree.backends import load

    with pytest.raises(BadFile, match="load budget") as caught:
        load(saved, memory_budget=10_000)
    message = str(caught.value)
    assert message.startswith(str(saved)) and "\n" not in message
    suggested = message.split(f"{ENV}=")[1].split()[0]
    monkeypatch.setenv(ENV, suggested)
    assert load(saved) is not None
    monkeypatch.delenv(ENV)
    by_argument = int(message.split("memory_budget=")[1].rstrip(")"))
    assert load(saved, memory_budget=by_argument) is not None


def test_charges_add_up_and_sizes_parse() -> None:
    budget = LoadBudget(10)
    budget.charge(6, "six bytes")
    with pytest.raises(LoadBudgetExceeded, match="five bytes needs 5 bytes"):
        budget.charge(5, "five bytes")
    assert parse_size("4G") == 4 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")
