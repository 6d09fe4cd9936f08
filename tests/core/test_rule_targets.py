"""Rule checks its targets: an op's name as a string matched no node, so the rule did
nothing and said nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.qdq import QUANTIZE_OPS

from support import batches


def _int8_output(node: torch.fx.Node) -> qt.Annotation:
    return qt.Annotation(outputs=qt.QuantSpec(qt.QDtype.INT8))


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2.0


def test_a_string_target_is_refused_and_the_op_it_names_works() -> None:
    with pytest.raises(qt.QuantreeError, match=r"'mul' is a string.*torch\.ops\.aten\.mul"):
        qt.Rule("mul", _int8_output)  # type: ignore[arg-type]
    with pytest.raises(qt.QuantreeError, match=r"'relu' is a string"):
        qt.Rule((torch.ops.aten.mul, "relu"), _int8_output)  # type: ignore[arg-type]
    rule = qt.Rule(torch.ops.aten.mul, _int8_output)  # type: ignore[arg-type]  # the fix
    assert rule.targets == (torch.ops.aten.mul,)  # one target alone is a 1-tuple
    data = batches((2, 8), n=4)
    prepared = qt.prepare(qt.capture(Doubler(), data[0]), qt.Quantizer([rule]))
    qt.calibrate(prepared, data, progress=False)
    reference = qt.convert(prepared)
    quantized = [n.args[0] for n in reference.graph.nodes if n.target in QUANTIZE_OPS]
    assert [n.target for n in quantized] == [torch.ops.aten.mul.Tensor]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"targets": (), "annotate": _int8_output}, "tuple of ops"),
        ({"targets": (3,), "annotate": _int8_output}, "is a int, not an op"),
        ({"targets": (torch.ops.aten.mul,), "annotate": 3}, "function of a node"),
        ({"targets": (torch.ops.aten.mul,), "annotate": _int8_output, "scope": 1}, "scope"),
    ],
)
def test_other_malformed_rules_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(qt.QuantreeError, match=match):
        qt.Rule(**kwargs)
