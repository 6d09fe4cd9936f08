"""addmm / mm / matmul with a constant [in, out] matrix are read as linear layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt

from support import batches, calls, output_sqnrs, run

aten = torch.ops.aten


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 projection: weight stored [in, out], ``addmm`` in forward."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.weight.shape[1])
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(shape)


class MatmulWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)


class TransposedWeight(nn.Module):
    """Falcon's ``FalconLinear``: an ``nn.Linear`` weight transposed on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


@pytest.mark.parametrize(
    ("model", "op"),
    [
        (Conv1D(16, 8), aten.addmm.default),
        (MatmulWeight(), aten.matmul.default),
        (TransposedWeight(), aten.matmul.default),
    ],
)
def test_constant_matrix_products_become_per_channel_linears(model: nn.Module, op) -> None:
    data = batches((3, 5, 16), n=8)
    assert calls(qt.capture(model.eval(), data[0]), op)  # the spelling the model has
    prepared, ref = run(model.eval(), data)
    assert not calls(prepared, op)
    (linear,) = calls(ref, aten.linear.default)
    weight_dq = linear.args[1]
    assert weight_dq.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
    assert weight_dq.args[0].op == "get_attr"  # the transposed weight is a folded constant
    with torch.no_grad():
        torch.testing.assert_close(prepared(*data[0]), model(*data[0]), rtol=1e-5, atol=1e-5)
    assert min(output_sqnrs(model, ref, data[0])) >= 30.0  # int8 in, per-channel weights


def test_matmul_of_two_activations_is_left_alone() -> None:
    class Scores(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a @ b.transpose(-1, -2)

    data = batches((2, 5, 8), (2, 5, 8), n=4)
    prepared, _ = run(Scores(), data)
    assert calls(prepared, aten.matmul.default) and not calls(prepared, aten.linear.default)
