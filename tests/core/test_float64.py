"""float64: a float64 model is refused with its fix; a float32 model's float64 values stay
float (pt2e's q/dq ops refuse float64, so a quantized float64 value broke the reference
graph: a raw ``RuntimeError`` at lowering, an ``AssertionError`` in the graph)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.qdq import QUANTIZE_OPS

from support import batches


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Positions(nn.Module):
    """A float32 model that computes a position table in float64 (as rotary tables are)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=torch.float64)
        table = (positions * 0.1).sin().mul(2.0).float()
        return self.b(self.a(x) + table)


def test_a_float64_model_is_refused_naming_a_parameter_and_the_fix_works() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    data = batches((4, 16), n=8)
    with pytest.raises(qt.QuantreeError, match=r"a\.weight .*float64.*model\.float\(\)"):
        qt.quantize(model.double(), (data[0][0].double(),), [(x.double(),) for (x,) in data])
    assert model.a.weight.dtype == torch.float64  # the user's model is not changed
    model = model.float()  # the fix the error names
    lowered = qt.quantize(model, data[0], data, progress=False)
    x = torch.randn(4, 16)
    assert qt.sqnr(model(x), lowered(x)) > 30


@pytest.mark.parametrize("backend", [None, "cpu"])
def test_float64_values_of_a_float32_model_stay_float(backend: str | None) -> None:
    torch.manual_seed(0)
    model = Positions().eval()
    data = batches((4, 16), n=8)
    out = qt.quantize(model, data[0], data, backend=backend, progress=False)
    reference = out.meta.get("quantree_reference", out) if backend else out
    quantized = [n for n in reference.graph.nodes if n.target in QUANTIZE_OPS]
    assert quantized, "the linears' points are quantized"
    for node in quantized:  # no q op reads a float64 value
        assert node.args[0].meta["val"].dtype != torch.float64, node
    x = torch.randn(4, 16)
    assert qt.sqnr(model(x), out(x)) > 30


def test_a_rule_quantizing_a_float64_value_is_refused_naming_the_node() -> None:
    def annotate(node: torch.fx.Node) -> qt.Annotation | None:
        if node.target is not torch.ops.aten.mul.Tensor:
            return None
        spec = qt.QuantSpec(qt.QDtype.INT8)
        return qt.Annotation(outputs=spec)

    quantizer = qt.Quantizer([qt.Rule((torch.ops.aten.mul,), annotate)])
    captured = qt.capture(Positions().eval(), (torch.randn(4, 16),))
    with pytest.raises(qt.QuantreeError, match=r"node mul .*torch\.float64.*give it None"):
        qt.prepare(captured, quantizer)
