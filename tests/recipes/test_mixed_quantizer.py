"""MixedQuantizer: a widened point and its readers take the wide spec; a float point's op
runs float and its readers read it at int16."""

from __future__ import annotations

import pytest
import torch

import quantree as qt
from quantree.recipes.mixed import MixedQuantizer, PointKey, Precision

Q = torch.ops.quantized_decomposed.quantize_per_tensor.default


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(x)) + 1.0)


def quantize_dtypes(choices: dict) -> dict[str, torch.dtype]:
    """Each node read through a quantize op, with that op's integer dtype."""
    args = (torch.randn(4, 8),)
    quantizer = MixedQuantizer(qt.Int8Quantizer(), qt.A16W8Quantizer(), choices)
    prepared = qt.prepare(qt.capture(Chain(), args), quantizer)
    qt.calibrate(prepared, [args], progress=False)
    ref = qt.convert(prepared)
    return {n.args[0].name: n.args[-1] for n in ref.graph.nodes if n.target == Q}


def test_a_widened_point_is_int16_up_to_its_readers():
    base = quantize_dtypes({})
    assert base["add"] == torch.int8
    wide = quantize_dtypes({PointKey("", "add"): Precision.INT16})
    # the add's output is int16 and the head reads it so (one quantize of the add, int16);
    # the add reads its int8 input again at int16 (exact); every other point is unchanged
    assert wide["add"] == torch.int16
    assert [v for k, v in wide.items() if k.startswith("dequantize")] == [torch.int16]
    original = {k: v for k, v in wide.items() if not k.startswith("dequantize")}
    assert original == base | {"add": torch.int16}


def test_a_float_point_runs_float_and_is_read_at_int16():
    with pytest.warns(qt.QuantreeWarning, match="left 1 op"):
        dtypes = quantize_dtypes({PointKey("", "add"): Precision.FLOAT})
    assert dtypes["add"] == torch.int16  # the head's input, not the add's own output


def test_choices_must_name_points_and_precisions_as_the_error_says():
    with pytest.raises(qt.QuantreeError, match="PointKey to a Precision"):
        MixedQuantizer(qt.Int8Quantizer(), qt.A16W8Quantizer(), {"add": "int16"})  # type: ignore[dict-item]
    MixedQuantizer(qt.Int8Quantizer(), qt.A16W8Quantizer(), {PointKey("", "add"): Precision.INT16})
