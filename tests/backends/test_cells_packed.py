"""A cells-mode loop over a packed sequence runs every step in one native call.

``quantree.cell_loop_packed`` runs step t on the ``batch_sizes[t]`` sequences still running
(the first rows); each row's arithmetic is the row's alone, so a packed batch must give
exactly what each sequence gives run alone through the plain loop, whatever the lengths,
in both directions. Bad ``batch_sizes`` (from a crafted file or a direct call) are refused
before the native call.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.cells.program import NativeCellLoop, cell_loop, cell_loop_packed

FEATURES, HIDDEN = 6, 10


class Packed(nn.Module):
    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


@functools.cache
def _loops(kind: str) -> list[NativeCellLoop]:
    """The lowered loops of a bidirectional layer, built on first use (not at collection, where
    every xdist worker would pay for them) and shared by the tests; seeded, so the same."""
    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](
        FEATURES, HIDDEN, batch_first=True, bidirectional=True
    )
    model = Packed(rnn).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 7, FEATURES, generator=g), torch.tensor([7, 5, 2])) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        lowered = qt.quantize(
            model, data[0], data, quantizer=qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS),
            backend=CPU, progress=False,
        )  # fmt: skip
    loops = [m for m in lowered.modules() if isinstance(m, NativeCellLoop)]
    assert len(loops) == 2  # forward and reverse
    return loops


def _alone(loop: NativeCellLoop, xs: list[torch.Tensor], states: list[list[torch.Tensor]]):
    """Each sequence through the plain loop, batch 1: its outputs and final states."""
    consts, tables = loop.program()
    runs = [
        cell_loop(x[:, None], [s[None] for s in state], consts, *tables, loop.reverse)
        for x, state in zip(xs, states, strict=True)
    ]
    return [(ys[:, 0], [f[0] for f in finals]) for ys, *finals in runs]


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["gru", "lstm"]),
    direction=st.sampled_from([0, 1]),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_packed_rows_equal_each_sequence_run_alone(kind, direction, lengths, seed) -> None:
    loop = _loops(kind)[direction]
    lengths = sorted(lengths, reverse=True)
    g = torch.Generator().manual_seed(seed)
    n_states = 2 if kind == "lstm" else 1
    xs = [torch.randn(n, FEATURES, generator=g) * 2 for n in lengths]
    states = [[torch.randn(HIDDEN, generator=g) for _ in range(n_states)] for _ in lengths]
    batch_sizes = torch.tensor([sum(n > t for n in lengths) for t in range(lengths[0])])
    rows = torch.cat([torch.stack([x[t] for x in xs if len(x) > t]) for t in range(lengths[0])])
    consts, tables = loop.program()
    initial = [torch.stack([s[k] for s in states]) for k in range(n_states)]
    ys, *finals = cell_loop_packed(rows, batch_sizes, initial, consts, *tables, loop.reverse)
    first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), batch_sizes]), 0)
    for i, (y_alone, finals_alone) in enumerate(_alone(loop, xs, states)):
        y_packed = torch.stack([ys[first[t] + i] for t in range(lengths[i])])
        assert torch.equal(y_packed, y_alone)
        for k in range(n_states):
            assert torch.equal(finals[k][i], finals_alone[k])


@pytest.mark.parametrize(
    "sizes",
    [[2, 3], [3, 0], [-1], [], [[3, 2]], [3.0, 2.0], [2, 2, 9]],
    ids=["increasing", "zero", "negative", "empty", "2-d", "float", "too many rows"],
)
def test_bad_batch_sizes_are_refused_before_the_native_call(sizes) -> None:
    loop = _loops("gru")[0]
    consts, tables = loop.program()
    batch_sizes = torch.tensor(sizes)
    xs = torch.randn(5, FEATURES)
    state = [torch.zeros(3, HIDDEN)]
    with pytest.raises(ValueError, match=r"batch_sizes|packed"):
        cell_loop_packed(xs, batch_sizes, state, consts, *tables, loop.reverse)


def test_states_of_another_batch_are_refused() -> None:
    loop = _loops("gru")[0]
    consts, tables = loop.program()
    with pytest.raises(ValueError, match="batch of 2"):
        cell_loop_packed(
            torch.randn(3, FEATURES), torch.tensor([2, 1]), [torch.zeros(4, HIDDEN)],
            consts, *tables, loop.reverse,
        )  # fmt: skip
