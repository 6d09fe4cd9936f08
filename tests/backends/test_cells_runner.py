"""Native cells-mode layers on their short call path compute what the op path computes.

``NativeRecurrentCells`` and ``CellLoopRunner`` (argument blocks built once, final states
made first and updated in place) replace the dispatcher path of ``quantree.cell_loop``
behind the generic ``RecurrentCells``; the native calls and their arguments are the same,
so every output must be equal bit for bit to that path's, which is what lowering ran before.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.cells.layer import NativeRecurrentCells
from quantree.backends.cpu.cells.program import NativeCellLoop
from quantree.backends.cpu.cells.runner import CellLoopRunner
from quantree.recurrent.loop import RecurrentCells

from support import leaves

CELLS = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)


class UnrolledDecoder(nn.Module):
    """An encoder-decoder whose decoder LSTM is called once per output step."""

    def __init__(self, steps: int = 4) -> None:
        super().__init__()
        self.steps = steps
        self.encoder = nn.LSTM(8, 16, batch_first=True)
        self.decoder = nn.LSTM(8, 16, batch_first=True)
        self.out = nn.Linear(16, 8)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(src)
        outs = []
        for t in range(self.steps):
            y, state = self.decoder(tgt[:, t : t + 1], state)
            outs.append(self.out(y))
        return torch.cat(outs, 1)


def op_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every native layer as before: generic ``RecurrentCells``, each loop through the
    dispatcher's ``quantree.cell_loop``."""

    def through_op(self, xs, state, consts, program, reverse):
        return torch.ops.quantree.cell_loop(xs, list(state), list(consts), *program, reverse)

    monkeypatch.setattr(NativeRecurrentCells, "forward", RecurrentCells.forward)
    monkeypatch.setattr(CellLoopRunner, "__call__", through_op)


def lowered(model: nn.Module, data: list[tuple]) -> torch.nn.Module:
    return qt.quantize(model, data[0], data, quantizer=CELLS, backend=CPU, progress=False)


def outputs(model: nn.Module, inputs: list[tuple]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [t for args in inputs for t in leaves(model(*args))]


def assert_equal(fast: list[torch.Tensor], slow: list[torch.Tensor]) -> None:
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_unrolled_decoder_is_bit_equal_to_the_op_path(monkeypatch):
    torch.manual_seed(0)
    model = UnrolledDecoder().eval()
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(2, 6, 8, generator=g), torch.randn(2, 4, 8, generator=g)) for _ in range(6)
    ]
    low = lowered(model, data)
    layers = [m for m in low.modules() if isinstance(m, RecurrentCells)]
    assert len(layers) == 5 and all(type(m) is NativeRecurrentCells for m in layers)
    fast = outputs(low, data)
    op_path(monkeypatch)
    assert_equal(fast, outputs(low, data))


STACKS = {
    "lstm-2x-bidirectional": (nn.LSTM(8, 16, 2, bidirectional=True, batch_first=True), 2),
    "gru": (nn.GRU(8, 12), 1),
    "rnn-tanh-2x": (nn.RNN(8, 12, 2), 1),
}


@pytest.mark.parametrize("stack", STACKS.values(), ids=STACKS.keys())
def test_layers_are_bit_equal_with_and_without_initial_states(stack, monkeypatch):
    torch.manual_seed(0)
    layer, n_states = stack
    module = copy.deepcopy(layer).eval()
    count = module.num_layers * (2 if module.bidirectional else 1)
    data = [(torch.randn(3, 5, 8),) for _ in range(4)]  # [batch, time] or [time, batch]
    low = lowered(module, data)
    assert any(type(m) is NativeRecurrentCells for m in low.modules())
    (cells,) = [m for m in low.modules() if isinstance(m, RecurrentCells)]
    batch_axis = 0 if module.batch_first else 1
    inputs = []
    for steps, batch in [(3, 5), (7, 2), (1, 1)]:
        x = torch.randn(batch, steps, 8) if module.batch_first else torch.randn(steps, batch, 8)
        hx = [torch.randn(count, x.shape[batch_axis], s) for s in cells.state_sizes]
        inputs += [(x, [None] * n_states), (x, hx if n_states > 1 else hx[0])]
    fast = outputs(cells, inputs)
    op_path(monkeypatch)
    assert_equal(fast, outputs(cells, inputs))


class PackedStack(nn.Module):
    """A 2-layer bidirectional layer over packed sequences, its final states returned too."""

    def __init__(self, layer: nn.RNNBase, sorted_: bool) -> None:
        super().__init__()
        self.layer, self.sorted = layer, sorted_

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, *hx: torch.Tensor):
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=self.sorted
        )
        state = (hx if len(hx) > 1 else hx[0]) if hx else None
        out, final = self.layer(packed, state)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[
            0
        ], final


PACKED = {
    "gru-sorted": (nn.GRU, True, False),
    "lstm-unsorted": (nn.LSTM, False, False),
    "gru-unsorted-with-states": (nn.GRU, False, True),
    "lstm-sorted-with-states": (nn.LSTM, True, True),
}


@pytest.mark.parametrize("case", PACKED.values(), ids=PACKED.keys())
def test_packed_sequences_take_the_short_path_bit_equal_to_the_op_path(case, monkeypatch):
    kind, sorted_, with_states = case
    torch.manual_seed(0)
    layer = kind(6, 10, num_layers=2, bidirectional=True, batch_first=True)
    model = PackedStack(layer, sorted_).eval()
    g = torch.Generator().manual_seed(1)

    def sample(lengths: list[int]) -> tuple:
        x = torch.randn(len(lengths), 7, 6, generator=g)
        n_states = 2 if kind is nn.LSTM else 1
        hx = tuple(torch.randn(4, len(lengths), 10, generator=g) for _ in range(n_states))
        return (x, torch.tensor(lengths), *(hx if with_states else ()))

    order = [7, 5, 2] if sorted_ else [5, 7, 2]
    data = [sample(order) for _ in range(4)]
    low = lowered(model, data)
    assert any(type(m) is NativeRecurrentCells for m in low.modules())
    inputs = [*data, sample([3, 3, 1] if sorted_ else [1, 3, 3]), sample([1, 1, 1])]

    def no_op_calls(*args, **kwargs):
        raise AssertionError("a packed loop went through quantree.cell_loop_packed")

    with monkeypatch.context() as patch:
        patch.setattr(NativeCellLoop, "forward", no_op_calls)
        fast = outputs(low, inputs)
    op_path(monkeypatch)
    assert_equal(fast, outputs(low, inputs))


def test_packed_batch_sizes_are_checked_once_for_every_loop():
    torch.manual_seed(0)
    data = [(torch.randn(3, 7, 6), torch.tensor([7, 5, 2])) for _ in range(3)]
    low = lowered(PackedStack(nn.GRU(6, 10, 2, batch_first=True), True).eval(), data)
    (cells,) = [m for m in low.modules() if isinstance(m, RecurrentCells)]
    rows = torch.randn(14, 6)
    with pytest.raises(Exception, match="not a packed sequence's"):
        cells(rows, None, torch.tensor([3, 3, 4, 2, 1, 1]))  # increasing
    with pytest.raises(Exception, match="not a packed sequence's"):
        cells(rows, None, torch.tensor([3, 3, 3, 2]))  # 11 rows, not 14


def test_copies_and_replaced_constants_rebuild_the_argument_block():
    torch.manual_seed(0)
    model = UnrolledDecoder(steps=2).eval()
    data = [(torch.randn(1, 5, 8), torch.randn(1, 2, 8)) for _ in range(4)]
    low = lowered(model, data)
    want = outputs(low, data)
    twin = copy.deepcopy(low)
    assert_equal(outputs(twin, data), want)
    for loop in [m for m in twin.modules() if isinstance(m, NativeCellLoop)]:
        for name, buffer in list(loop.named_buffers(recurse=False)):
            setattr(loop, name, buffer.clone())  # other tensors, the same values
    assert_equal(outputs(twin, data), want)
    twin.load_state_dict(low.state_dict())  # copied in place: the block stays valid
    assert_equal(outputs(twin, data), want)


def test_a_wrong_width_is_named_by_the_loop():
    torch.manual_seed(0)
    data = [(torch.randn(5, 2, 8),) for _ in range(3)]
    low = lowered(nn.LSTM(8, 16).eval(), data)
    (cells,) = [m for m in low.modules() if isinstance(m, RecurrentCells)]
    with pytest.raises(ValueError, match="compiled for"):
        cells(torch.randn(5, 2, 9), [None, None])


def test_saved_model_runs_the_op_and_equals_the_lowered_one(tmp_path):
    torch.manual_seed(0)
    model = UnrolledDecoder(steps=3).eval()
    data = [(torch.randn(1, 5, 8), torch.randn(1, 3, 8)) for _ in range(4)]
    low = lowered(model, data)
    path = tmp_path / "model.pt2"
    save(low, path, data[0])
    assert_equal(outputs(load(path), data), outputs(low, data))
