"""xLSTM's chunkwise mLSTM pattern: each step writes the state it received into its slot of a
buffer one slot longer than the run, the last slot written after the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.recurrent.unrolled.step_loop import StepLoop


class WritesCarried(nn.Module):
    """Two buffers like xLSTM's: ``hs`` by ``select`` (``hs[:, t] = h``), ``Cs`` by ``slice``
    (``Cs[:, 4t:4t+4] = C``), each step writing the state entering it, then
    ``hs[:, -1] = h``, ``Cs[:, -4:] = C`` after the loop. ``how`` picks a variant; all but
    ``fold`` must stay unrolled: ``wrong_slot`` (slot ``t + 1``), ``read`` (the step reads
    its slot after writing it), ``read_between`` (the buffer read before the closing write),
    ``partial`` (no closing write: the last slot stays zero), ``wrong_value`` (the closing
    write is not the final state)."""

    def __init__(self, how: str = "fold") -> None:
        super().__init__()
        self.how = how
        self.gate = nn.Linear(4, 4)
        self.inp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):  # [B, T, 4]
        a, u = self.gate(x), self.inp(x)  # no elementwise producer: nothing moves, exact
        batch, steps, how = x.shape[0], x.shape[1], self.how
        h, c = torch.zeros(batch, 4), torch.zeros(batch, 4, 4)
        hs = torch.zeros(batch, steps + 1 + (how == "wrong_slot"), 4)
        cs = torch.zeros(batch, 4 * (steps + 1), 4)
        for t in range(steps):
            if how == "wrong_slot":
                hs[:, t + 1] = h
            else:
                hs[:, t] = h
            cs[:, 4 * t : 4 * (t + 1)] = c
            if how == "read":
                h = h + hs[:, t].sum()
            c = torch.clamp(a[:, t, :, None] * c + u[:, t, :, None] * u[:, t, None, :], -9.0, 9.0)
            h = torch.tanh(a[:, t] * h + u[:, t])
        early = hs * 1 if how == "read_between" else None
        if how != "partial":
            hs[:, -1] = h if how != "wrong_value" else h * 2
        cs[:, -4:] = c
        return (hs, cs) if early is None else (hs, cs, early)


def _copies(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == torch.ops.aten.copy_.default)


def test_a_buffer_of_received_states_closed_after_the_loop_folds_exactly_at_any_length():
    torch.manual_seed(0)
    model = WritesCarried().eval()
    x = torch.randn(2, 9, 4)
    unrolled = qt.capture(model, (x,), fold_loops=False)
    folded = qt.capture(model, (x,), fold_loops=True)
    assert _copies(unrolled) == 20  # 2 per step, 2 after the loop
    (loop,) = [m for m in folded.modules() if isinstance(m, StepLoop)]
    assert loop.free and _copies(folded) == 0 and _copies(loop.body) == 0
    joins = [n for n in folded.graph.nodes if n.target == torch.ops.aten.cat.default]
    assert len(joins) == 2  # per buffer: the initial state, then the loop's states
    for a, b in zip(folded(x), unrolled(x), strict=True):
        assert torch.equal(a, b)  # the same ops on the same tensors
    for length in (1, 17, 40):  # captured at 9
        y = torch.randn(3, length, 4)
        for a, b in zip(folded(y), model(y), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["wrong_slot", "read", "read_between", "partial", "wrong_value"])
def test_a_buffer_of_received_states_not_provably_closed_stays_unrolled(how):
    torch.manual_seed(0)
    model = WritesCarried(how).eval()
    x = torch.randn(2, 9, 4)
    gm = qt.capture(model, (x,), fold_loops=True)
    assert not [m for m in gm.modules() if isinstance(m, StepLoop)]
    assert _copies(gm) == 20 - (how == "partial")
    for a, b in zip(gm(x), model(x), strict=True):
        assert torch.equal(a, b)  # as unrolled


def test_a_step_length_is_tried_when_shorter_gaps_are_more_frequent(monkeypatch):
    """The step's length is a gap between equal ops only for its ops that occur once per step
    (here ``tanh`` and ``clamp``: 2 x (T - 1) times), fewer than the gaps between its many
    ``slice``/``select``/``mul`` when the run is short (xLSTM's 4 chunks at 64 tokens): it is
    still tried, as the gap covering the most nodes. Two candidates of each kind here, so
    that the most frequent gaps alone miss it."""
    from quantree.recurrent.unrolled import find
    from quantree.recurrent.unrolled.fold import fold_loops

    monkeypatch.setattr(find, "MAX_PERIODS", 2)
    torch.manual_seed(0)
    model = WritesCarried().eval()
    x = torch.randn(2, 4, 4)
    gm = qt.capture(model, (x,), fold_loops=False)
    assert len(fold_loops(gm, min_steps=3)) == 1 and _copies(gm) == 0
    for a, b in zip(gm(x), model(x), strict=True):
        assert torch.equal(a, b)
