"""A convolution over an unbatched input ([C, H, W] or [C, L]) stays in the reference form on
the CPU backend: the native kernels read [N, C, ...], and lowering it made the lowered model
refuse its own example with a NativeArgumentError (found by the compare property test)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU


@pytest.mark.parametrize(
    ("conv", "shape"),
    [(nn.Conv2d(3, 4, 3), (3, 8, 8)), (nn.Conv1d(3, 4, 3), (3, 16))],
    ids=["conv2d", "conv1d"],
)
def test_an_unbatched_convolution_runs_lowered(conv: nn.Module, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(conv, nn.ReLU()).eval()
    data = [(torch.randn(*shape),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        reference = qt.quantize(model, data[0], data, backend=qt.REFERENCE, progress=False)
        lowered = qt.lower(reference, CPU)
    with torch.no_grad():
        for (x,) in data:
            assert torch.equal(lowered(x), reference(x))


def test_a_batched_convolution_is_still_native() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    data = [(torch.randn(2, 3, 8, 8),)]
    lowered = qt.quantize(model, data[0], data, backend=CPU, progress=False)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert "quantree.conv2d.default" in targets
