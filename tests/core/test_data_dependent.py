"""Capture of a model whose Python reads a tensor's value to build a shape."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU

from support import output_sqnrs


class PaddedEncoder(nn.Module):
    """torchaudio's Conformer builds its padding mask as ``arange(int(lengths.max()))``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        max_length = int(torch.max(lengths).item())
        padding = torch.arange(max_length).expand(lengths.shape[0], max_length) >= lengths[:, None]
        return self.proj(x).masked_fill(padding[..., None], 0.0)


def _data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 10, 8, generator=g), torch.tensor([10, 4 + i % 6])) for i in range(n)]


def test_a_shape_read_from_a_tensor_is_captured_on_the_example_with_checks() -> None:
    """Before: "torch.export could not capture ...: Could not extract specialized integer from
    data-dependent expression u0" (Conformer, in quantree and torchao alike)."""
    torch.manual_seed(0)  # the weights: the SQNR below was measured on these (27.6 dB on others)
    model, data = PaddedEncoder().eval(), _data(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    (note,) = [str(w.message) for w in caught if "tensor's value" in str(w.message)]
    assert "Eq(u0, 10)" in note  # the mask's length is the example's sequence length
    held = _data(2, seed=1)[1]
    assert min(output_sqnrs(model, ref, held)) >= 30.0
    lowered = qt.lower(ref, CPU)
    with torch.no_grad():
        out = lowered(*held)  # lengths [10, 5]: the second row's padding is zero
        assert bool((out[1, int(held[1][1]) :] == 0).all()) and bool((out[0] != 0).any(-1).all())
        with pytest.raises(Exception, match="u0"):  # a batch padded past its longest row
            lowered(held[0], torch.tensor([7, 7]))
