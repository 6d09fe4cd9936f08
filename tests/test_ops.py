"""Per-op behaviour of the default recipe beyond the nested cases: conv, bn folding, pools."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import quantree as qt

from support import assert_prepared_exact, batches, calls, output_sqnrs, run


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU6(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.conv1d = nn.Conv1d(4, 4, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x, seq):
        return self.head(self.features(x)), torch.relu(self.conv1d(seq)).mean(-1)


def test_conv_net_is_fully_quantized_with_batch_norm_folded():
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        bn = model.features[1]
        (
            bn.running_mean.uniform_(-1, 1),
            bn.running_var.uniform_(0.5, 2.0),
            bn.weight.uniform_(0.5, 2),
        )
    data = batches((2, 3, 12, 12), (2, 4, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # every op has a rule
        prepared, ref = run(model, data)
    assert not calls(ref, torch.ops.aten.batch_norm.default)
    assert len(calls(ref, torch.ops.aten.conv2d.default)) == 2
    with torch.no_grad():  # folding changes rounding only
        for a, b in zip(model(*data[0]), prepared(*data[0]), strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


def test_prepared_equals_float_exactly_without_batch_norm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AvgPool2d(2)).eval()
    data = batches((2, 3, 8, 8))
    prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0
