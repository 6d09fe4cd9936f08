"""A spelled-out tanh GELU (GPT-2's ``NewGELUActivation``) is read as one ``aten.gelu``."""

from __future__ import annotations

import math

import torch
from torch import nn

import quantree as qt
from quantree.core.normalizing.normalize import normalize

from support import batches, calls, run

aten = torch.ops.aten


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``NewGELUActivation``, as GPT-2 writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(new_gelu(self.up(x)))


class SharedStep(nn.Module):
    """The chain's tanh is read twice: not a GELU on its own, left as written."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0)))
        return 0.5 * x * (1.0 + t) + t


def test_spelled_out_tanh_gelu_becomes_one_gelu() -> None:
    model = Mlp().eval()
    (x,) = batches((4, 16), n=1)[0]
    gm = normalize(qt.capture(model, (x,)))
    (gelu,) = calls(gm, aten.gelu.default)
    assert gelu.kwargs.get("approximate") == "tanh"
    for op in (aten.tanh.default, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.add.Tensor):
        assert calls(gm, op) == []
    # the same formula evaluated in one op: float rounding apart (measured 2e-7)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=1e-6)


def test_a_chain_read_elsewhere_is_left_alone() -> None:
    (x,) = batches((4, 16), n=1)[0]
    gm = normalize(qt.capture(SharedStep().eval(), (x,)))
    assert calls(gm, aten.gelu.default) == []
    assert len(calls(gm, aten.tanh.default)) == 1


def test_every_op_recipe_quantizes_the_gelu_as_one_op() -> None:
    """Under EVERY_OP the eight steps were eight rounded activations; now one."""
    data = batches((4, 16), n=6)
    quantizer = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)
    _, ref = run(Mlp().eval(), data, quantizer)
    (gelu,) = calls(ref, aten.gelu.default)
    assert gelu.args[0].target == torch.ops.quantized_decomposed.dequantize_per_tensor.default
