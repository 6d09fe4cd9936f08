"""Region-program and cell-loop tables from a file are bounded by what the program needs
when the file loads (``table_needs.py``), not only kept inside the workspace they lay out.

On c04c399 a row stride of 2**31 - 1 in a 9 KB file loaded, and the first call allocated
and cleared gigabytes (``std::bad_alloc`` through ``extern "C"``: SIGABRT under a limit).
The tables are crafted before saving: the file stores them narrowed and pooled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_program import NormedLSTM, _data
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.core.graphs import fetch_attr
from quantree.tools.files import BadFile

HUGE_STRIDE = 2**31 - 1


def _owner_stride(module: torch.fx.GraphModule, op: object, slots_arg: int) -> None:
    """The first slot owning storage of ``op``'s table says its rows are 2**31 - 1 apart."""
    ((holder, node),) = [
        (m, n)
        for m in module.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if getattr(n.target, "op", n.target) == op
    ]
    target = str(node.args[slots_arg].target)
    slots = fetch_attr(holder, target).clone()
    owner = next(i for i in range(slots.shape[0]) if slots[i, 1] == i)
    slots[owner, 4] = HUGE_STRIDE
    owner_of, _, leaf = target.rpartition(".")
    setattr(fetch_attr(holder, owner_of) if owner_of else holder, leaf, slots)


@pytest.fixture(scope="module")
def program_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.manual_seed(0)
    data = _data()
    low = qt.lower(qt.quantize(NormedLSTM().eval(), data[0], data, progress=False), CPU)
    root = tmp_path_factory.mktemp("tables")
    save(low, root / "honest.pt2", data[0])
    _owner_stride(low, torch.ops.quantree.program.default, 4)
    save(low, root / "stride.pt2", data[0])
    return root / "honest.pt2", root / "stride.pt2"


class Cells(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.fc = nn.LSTM(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.lstm(x)[0])


def test_a_program_row_stride_past_its_width_is_refused_at_load(program_files) -> None:
    honest, crafted = program_files
    assert load(honest) is not None
    # native.program_checks refuses a non-dense owner first (table_needs would too)
    with pytest.raises(BadFile, match=r"quantree\.program: slot \d+ owns its storage with a "
                       f"row stride of {HUGE_STRIDE} for") as caught:  # fmt: skip
        load(crafted)
    assert str(caught.value).startswith(str(crafted)) and "\n" not in str(caught.value)


def test_a_cell_loop_row_stride_past_its_width_is_refused_at_load(tmp_path) -> None:
    torch.manual_seed(0)
    data = [(torch.randn(5, 2, 8),) for _ in range(4)]
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    low = qt.quantize(Cells().eval(), data[0], data, quantizer=quantizer, backend=CPU,
                      progress=False)  # fmt: skip
    (holder,) = [m for m in low.modules() if getattr(m, "slots", None) is not None]
    slots = holder.slots.clone()  # the native cell loop's table (cells_native.NativeCells)
    owner = next(i for i in range(slots.shape[0]) if slots[i, 1] == i)
    slots[owner, 4] = HUGE_STRIDE
    holder.slots = slots
    save(low, tmp_path / "cells.pt2", data[0])
    with pytest.raises(BadFile, match=rf"quantree\.cell_loop: slot \d+ .* {HUGE_STRIDE} for"):
        load(tmp_path / "cells.pt2")
