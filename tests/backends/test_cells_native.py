"""nn.LSTMCell / GRUCell / RNNCell steps (``aten.*_cell``) lower to one native call each.

The cell runs on the whole-layer kernel with one time step, so its weights are never
dequantized; against the reference graph it differs only by float rounding of the gate
arithmetic (checked by SQNR over several steps, where errors feed back through the state).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.saved.derived import RECIPE_KEY
from quantree.tools.metrics import sqnr

from support import calls

aten = torch.ops.aten
CELLS = {
    "lstm": (nn.LSTMCell, aten.lstm_cell.default),
    "gru": (nn.GRUCell, aten.gru_cell.default),
    "rnn_tanh": (lambda i, h, bias=True: nn.RNNCell(i, h, bias), aten.rnn_tanh_cell.default),
    "rnn_relu": (
        lambda i, h, bias=True: nn.RNNCell(i, h, bias, nonlinearity="relu"),
        aten.rnn_relu_cell.default,
    ),
}


class Decoder(nn.Module):
    """A decoder stepping one cell over a sequence, as Tacotron2's does (state from zeros)."""

    def __init__(self, kind: str, bias: bool = True, steps: int = 5) -> None:
        super().__init__()
        self.kind, self.steps = kind, steps
        self.inp = nn.Linear(12, 24)
        self.cell = CELLS[kind][0](24, 32, bias=bias)
        self.out = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 32)
        c = x.new_zeros(x.shape[0], 32)
        outs = []
        for t in range(self.steps):
            step = torch.relu(self.inp(x[:, t]))
            if self.kind == "lstm":
                h, c = self.cell(step, (h, c))
            else:
                h = self.cell(step, h)
            outs.append(self.out(h))
        return torch.stack(outs, 1)


def _data(n: int = 8, seed: int = 0) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 5, 12, generator=g),) for _ in range(n)]


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_cell_lowers_to_one_native_call_per_step(kind: str, bias: bool) -> None:
    data = _data()
    model = Decoder(kind, bias).eval()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    assert len(calls(low, torch.ops.quantree.rnn_cell.default)) == 5
    assert not calls(low, CELLS[kind][1])
    held = _data(3, seed=1)  # never calibrated on
    with torch.no_grad():
        for (x,) in held:
            r, q = ref(x), low(x)
            print(kind, bias, sqnr(r, q))
            assert sqnr(r, q) > 35.0, (kind, sqnr(r, q))


def test_unbatched_cell_and_save_load(tmp_path) -> None:
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(8, 16)

        def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
            return self.cell(x, (h, c))

    g = torch.Generator().manual_seed(1)
    data = [tuple(torch.randn(n, generator=g) for n in (8, 16, 16)) for _ in range(6)]
    ref = qt.quantize(One().eval(), data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    assert len(calls(low, torch.ops.quantree.rnn_cell.default)) == 1
    # both biases are saved as recipes on the float biases (derived.py)
    assert sum(RECIPE_KEY in n.meta for n in low.graph.nodes if n.op == "get_attr") == 2
    with torch.no_grad():
        for args in data:
            for r, q in zip(ref(*args), low(*args), strict=True):
                assert q.shape == r.shape == (16,)
                assert sqnr(r, q) > 35.0
    save(low, tmp_path / "cell.pt2", data[0])
    loaded = load(tmp_path / "cell.pt2")
    with torch.no_grad():
        for a, b in zip(loaded(*data[1]), low(*data[1]), strict=True):
            assert torch.equal(a, b)
