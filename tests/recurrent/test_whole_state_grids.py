"""Whole mode: returned states on their own grids by default, the initial state's by option.

An initial state drawn from N(0, 1) is wider than an LSTM's h_n (inside (-1, 1)); sharing
its grid cost h_n 7 dB here (31.5 -> 24.5 dB) and 10-20 dB on other models.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import quantree as qt
from quantree.backends import CPU
from quantree.core.stages import NODE_KEY
from quantree.recurrent.call import RECURRENT_OPS


class WithState(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, batch_first=True)

    def forward(self, x, hx):
        return self.rnn(x, hx)


def _batch(kind: str, g: torch.Generator):
    x, h = torch.randn(4, 10, 8, generator=g), torch.randn(1, 4, 16, generator=g)
    return (x, (h, torch.randn(1, 4, 16, generator=g)) if kind == "LSTM" else h)


def _sqnrs(model, quantized, data) -> list[float]:
    with torch.no_grad():
        ref = [tree_leaves(model(*b)) for b in data]
        got = [tree_leaves(quantized(*b)) for b in data]
    return [
        qt.sqnr(torch.cat([r[i].flatten() for r in ref]), torch.cat([q[i].flatten() for q in got]))
        for i in range(len(ref[0]))
    ]


def _quantize(kind: str, share: bool):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = WithState(kind).eval()
    data = [_batch(kind, g) for _ in range(12)]
    held_out = [_batch(kind, g) for _ in range(4)]
    quantizer = qt.Int8Quantizer(share_recurrent_state=share)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
        qt.calibrate(prepared, data, progress=False)
    return model, prepared, qt.convert(prepared), held_out


def _state_groups(prepared) -> list[tuple[int, int]]:
    """(initial state's group, returned state's group) of each state of the layer."""
    (node,) = [n for n in prepared.graph.nodes if n.target in RECURRENT_OPS]
    quant = node.meta[NODE_KEY]
    initial = sorted(p for p in quant.input_groups if p[0] == 1)
    return [
        (quant.input_groups[path], quant.output_groups[(k,)])
        for k, path in enumerate(initial, start=1)
    ]


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_returned_states_have_their_own_grids_by_default(kind):
    model, prepared, converted, held_out = _quantize(kind, share=False)
    assert all(a != b for a, b in _state_groups(prepared))
    own = _sqnrs(model, converted, held_out)
    _, _, shared_model, _ = _quantize(kind, share=True)
    shared = _sqnrs(model, shared_model, held_out)
    assert min(own) > 28.0, own
    assert own[1] >= shared[1] - 0.5  # never worse than sharing
    if kind == "LSTM":  # h0 ~ N(0, 1) is far wider than h_n in (-1, 1)
        assert own[1] > shared[1] + 4.0, (own, shared)
    lowered = _sqnrs(model, qt.lower(converted, CPU), held_out)
    assert all(low > ref - 1.0 for low, ref in zip(lowered, own, strict=True)), (lowered, own)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_share_recurrent_state_keeps_one_grid_for_streaming(kind):
    model, prepared, converted, held_out = _quantize(kind, share=True)
    assert all(a == b for a, b in _state_groups(prepared))
    lowered = qt.lower(converted, CPU)
    ref, low = _sqnrs(model, converted, held_out), _sqnrs(model, lowered, held_out)
    assert all(x > r - 1.0 for x, r in zip(low, ref, strict=True)), (low, ref)
    # streaming: the returned state fed back as the next call's initial state
    x = held_out[0][0]
    with torch.no_grad():
        _, state = lowered(x, held_out[0][1])
        out, _ = lowered(x, state)
        want, _ = model(x, model(x, held_out[0][1])[1])
    assert qt.sqnr(want, out) > 25.0


def test_share_recurrent_state_must_be_a_bool():
    with pytest.raises(qt.QuantreeError, match="share_recurrent_state"):
        qt.Int8Quantizer(share_recurrent_state="yes")  # type: ignore[arg-type]
