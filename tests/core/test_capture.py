"""capture: the batch dimension varies for every forward signature torch.export takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt

from support import Tokens


class VarArgs(nn.Module):
    """``forward(self, *inputs)``: one parameter holding every input."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return inputs[0].mean(1, keepdim=True) + inputs[1]


class Mixed(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return x + rest[0] + rest[1]


def test_a_var_positional_forward_keeps_a_varying_batch() -> None:
    """Its dynamic shapes were once given one entry per input; export refused them and
    capture fell back to fixing the batch at the example's."""
    gm = qt.capture(VarArgs(), (torch.randn(2, 4), torch.randn(2, 1)))
    a, b = torch.randn(3, 4), torch.randn(3, 1)
    assert torch.equal(gm(a, b), VarArgs()(a, b))


def test_named_and_var_positional_inputs_keep_a_varying_batch() -> None:
    example = torch.randn(2, 3)
    gm = qt.capture(Mixed(), (example, example, example))
    a, b, c = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3)
    assert torch.equal(gm(a, b, c), a + b + c)


class Difference(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x - y


def test_one_tensor_given_for_two_inputs_captures_two_inputs() -> None:
    """torch.export traces aliasing example inputs as one input: the graph computed y - y
    whatever x was."""
    example = torch.randn(2, 3)
    kept = example.clone()
    gm = qt.capture(Difference(), (example, example))
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert torch.equal(gm(a, b), a - b)
    assert torch.equal(example, kept)


@pytest.mark.parametrize("view", ["slice", "transpose"])
def test_an_example_that_is_a_view_captures_a_model_plain_tensors_can_call(view) -> None:
    """torch.export guarded the example's ``_base`` (``tokens._base.size()[1] != 8``): every
    call with a plain tensor failed with a raw AttributeError, and so did re-export (ONNX,
    ExecuTorch)."""
    torch.manual_seed(0)
    model = Tokens().eval()
    longer = torch.randint(0, 20, (4, 16))
    example = longer[:, :8] if view == "slice" else longer[:8].t()
    assert example._base is not None
    gm = qt.capture(model, (example,))
    fresh = torch.randint(0, 20, tuple(example.shape))
    assert torch.equal(gm(fresh), model(fresh))
    assert torch.equal(gm(example), model(example))
    torch.export.export(gm, (fresh,))  # re-export traces the guard too
    assert example._base is longer  # the user's tensor is untouched
