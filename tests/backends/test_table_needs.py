"""A loaded program's workspace at its example's size is charged to the load budget
(``backends/cpu/saved/checks/table_needs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_program import NormedLSTM, _data

import quantree as qt
from quantree.backends import CPU, save
from quantree.backends.cpu.saved.checks.load_budget import LoadBudget
from quantree.backends.cpu.saved.checks.table_needs import check_loaded_tables
from quantree.backends.cpu.saved.derived import fold_recipes
from quantree.tools.files import load_program


@pytest.fixture(scope="module")
def program_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    data = _data()
    low = qt.lower(qt.quantize(NormedLSTM().eval(), data[0], data, progress=False), CPU)
    path = tmp_path_factory.mktemp("needs") / "honest.pt2"
    save(low, path, data[0])
    return path


def test_the_workspace_at_the_example_size_is_charged_to_the_budget(program_file) -> None:
    """The honest program's workspace is small, but it is charged: a budget of a few bytes
    refuses it, naming the node."""
    module = load_program(program_file).module()
    fold_recipes(module)
    check_loaded_tables(module, LoadBudget(1 << 20))
    with pytest.raises(qt.QuantreeError, match=r"node \w+'s workspace"):
        check_loaded_tables(module, LoadBudget(16))
