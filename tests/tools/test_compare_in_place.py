"""compare reads every tensor as its op produced it, whatever in-place ops do to it later.

ResNet's block overwrites tensors in place (``ReLU(inplace=True)``, ``out += identity``);
torch.export keeps those as ``relu_``/``add_``. A row read after the overwrite compares the
float tensor of one op with the quantized tensor of another (measured before the fix: rows at
-0.4 to -0.1 dB on this block while its output was at 37 dB).
"""

from __future__ import annotations

import pytest
import torch
from per_op_reference import assert_rows_match, float_graph
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.tools.compare import RowKind

ROW_FLOOR_DB = 25.0
"""Every value row of the block at int8: measured 37-41 dB (per-tensor activations,
per-channel weights, 8 channels); a row read after an overwrite reads about 0 dB."""


class Block(nn.Module):
    """conv -> relu_ -> conv -> add_ (the identity) -> relu_, as torchvision's BasicBlock."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.c2(self.relu(self.c1(x)))
        out += x
        return self.relu(out)


@pytest.fixture(scope="module")
def block() -> tuple[nn.Module, torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = Block().eval()
    data = [(torch.randn(2, 8, 8, 8),) for _ in range(4)]
    ref = qt.quantize(model, data[0], data, backend=qt.REFERENCE, progress=False)
    return model, ref, data


@pytest.mark.parametrize("lowered", [False, True], ids=["reference", "cpu"])
def test_rows_are_read_before_in_place_writes(block, lowered: bool) -> None:
    model, ref, data = block
    quantized = qt.lower(ref, CPU) if lowered else ref
    comparison = qt.compare(model, quantized, data[:2])
    values = {r.name: r for r in comparison.rows if r.kind is RowKind.VALUE}
    # the tensors add_ and the second relu_ overwrite: conv2d_1's output, the sum
    assert {"conv2d_1", "add_"} <= set(values), comparison.render()
    assert min(r.sqnr_db for r in values.values()) >= ROW_FLOOR_DB, comparison.render()
    assert_rows_match(comparison, float_graph(model, data[0]), quantized, data[:2])
    # the sum is read only by the ReLU: compared as the ReLU sees it, and the row says so
    assert values["add_"].clamped == (0.0, float("inf"))
    assert "add_ [0, inf]" in comparison.render()
    assert values["conv2d_1"].clamped is None  # read by the add: the whole tensor


def test_the_eager_float_and_the_batches_are_left_as_they_were(block) -> None:
    """A model writing into its own input would otherwise hand the next one a changed batch."""

    class WritesInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2.0)
            return self.fc(x)

    torch.manual_seed(0)
    model = WritesInput().eval()
    data = [(torch.randn(3, 4),) for _ in range(3)]
    ref = qt.quantize(model, (data[0][0].clone(),), [(x.clone(),) for (x,) in data],
                      backend=qt.REFERENCE, progress=False)  # fmt: skip
    before = [x.clone() for (x,) in data]
    comparison = qt.compare(model, ref, data)
    assert all(torch.equal(x, b) for (x,), b in zip(data, before, strict=True))
    (output,) = comparison.outputs
    assert output.sqnr_db > 25.0, comparison.render()  # measured 40 dB; a doubled input: ~0


def test_the_prepared_model_as_float_is_read_before_in_place_writes(block) -> None:
    """The prepared graph keeps ``relu_``/``add_`` too: the same rows, read the same way."""
    model, ref, data = block
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    comparison = qt.compare(prepared, ref, data[:2])
    values = [r for r in comparison.rows if r.kind is RowKind.VALUE]
    assert {"conv2d_1", "add_"} <= {r.name for r in values}, comparison.render()
    assert min(r.sqnr_db for r in values) >= ROW_FLOOR_DB, comparison.render()
    assert_rows_match(comparison, prepared, ref, data[:2])
