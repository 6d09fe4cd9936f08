"""Every observer kind calibrates recurrent layers well, in whole and cells mode.

A default (zero) initial state and the zero state at a loop's first step used to pin the
moving average near 0 (GRU h_n at 0.8-2 dB whole, the output at 5-16 dB cells).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import quantree as qt

KINDS = list(qt.ObserverKind)
MODES = [qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS]


class Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, batch_first=True)

    def forward(self, x):
        return self.rnn(x)  # the default zero initial state


def _leaf_sqnrs(model, quantized, data):
    with torch.no_grad():
        ref = [tree_leaves(model(*b)) for b in data]
        got = [tree_leaves(quantized(*b)) for b in data]
    return [
        qt.sqnr(torch.cat([r[i].flatten() for r in ref]), torch.cat([g[i].flatten() for g in got]))
        for i in range(len(ref[0]))
    ]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
@pytest.mark.parametrize("layer", ["GRU", "LSTM"])
def test_every_observer_suits_a_recurrent_layer_with_zero_initial_state(layer, kind, mode):
    torch.manual_seed(0)
    model = Recurrent(layer).eval()
    data = [(torch.randn(4, 10, 8),) for _ in range(8)]
    held_out = [(torch.randn(4, 10, 8),) for _ in range(3)]
    quantizer = qt.Int8Quantizer(activation_observer=kind, recurrent=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        quantized = qt.quantize(
            model, data[0], data, quantizer=quantizer, progress=False, backend="reference"
        )
    sqnrs = _leaf_sqnrs(model, quantized, held_out)
    assert min(sqnrs) > 20.0, sqnrs  # min-max: 30-40 dB; moving average was 0.8-16 dB
