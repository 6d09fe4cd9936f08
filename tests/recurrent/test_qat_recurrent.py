"""QAT of recurrent layers: whole mode (the float aten.lstm/gru/rnn trains between fake
quantization) and cells mode (fake quantization inside every step), for LSTM/GRU/RNN,
bidirectional, multi-layer, proj_size and packed sequences.

Each case trains a few steps (the loss falls; weights and learned scales get non-zero
gradients), and converts: before training a QAT model converts to the very graph
post-training quantization gives with the same calibration (same nodes, same outputs); after
training its reference graph computes exactly what the QAT model computes (the fake
quantization is the reference graph's arithmetic in float).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import quantree as qt
from quantree.core.training.fake_quant import FixedFakeQuant, LearnedFakeQuant
from quantree.core.training.qat import fake_quant_modules

BATCH, STEPS, FEATURES, HIDDEN = 3, 5, 6, 8
WHOLE, CELLS = qt.RecurrentMode.WHOLE, qt.RecurrentMode.CELLS


class Head(nn.Module):
    """A recurrent layer and a linear head: what the char-LM is."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        out = rnn.hidden_size if not getattr(rnn, "proj_size", 0) else rnn.proj_size
        self.head = nn.Linear(out * (2 if rnn.bidirectional else 1), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


class PackedHead(Head):
    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(out)


CASES = {
    "lstm": lambda: nn.LSTM(FEATURES, HIDDEN, batch_first=True),
    "gru": lambda: nn.GRU(FEATURES, HIDDEN, batch_first=True),
    "rnn": lambda: nn.RNN(FEATURES, HIDDEN, batch_first=True),
    "lstm-bidir-2layers": lambda: nn.LSTM(
        FEATURES, HIDDEN, 2, batch_first=True, bidirectional=True
    ),
    "gru-2layers": lambda: nn.GRU(FEATURES, HIDDEN, 2, batch_first=True),
    "lstm-proj": lambda: nn.LSTM(FEATURES, HIDDEN, batch_first=True, proj_size=5),
}


def _data(packed: bool, n: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        x = torch.randn(BATCH, STEPS, FEATURES, generator=g)
        if not packed:
            items.append((x,))
            continue
        lengths = torch.randint(1, STEPS + 1, (BATCH,), generator=g)
        lengths[0] = STEPS
        items.append((x, lengths))
    return items


def _train(qat: torch.fx.GraphModule, data: list[tuple[torch.Tensor, ...]], steps: int = 6):
    """A few Adam steps towards a fixed target; (losses, the first step's gradients)."""
    torch.manual_seed(1)
    target = torch.randn(BATCH, STEPS, 4)
    named = list(qat.named_parameters())
    scales = [p for n, p in named if n.endswith(".scale")]
    others = [p for n, p in named if not n.endswith(".scale")]
    # Adam moves every parameter by about lr a step: scales (~0.01) need a smaller one
    optimizer = torch.optim.Adam([{"params": others, "lr": 1e-2}, {"params": scales, "lr": 1e-4}])
    losses, grads = [], {}
    for step in range(steps):
        loss = ((qat(*data[0]) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            grads = {
                name: p.grad.clone() for name, p in qat.named_parameters() if p.grad is not None
            }
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


def _case(name: str, mode: qt.RecurrentMode, packed: bool = False):
    torch.manual_seed(0)
    model = (PackedHead if packed else Head)(CASES[name]()).eval()
    data = _data(packed)
    quantizer = qt.Int8Quantizer(recurrent=mode)
    return model, data, quantizer


FULL = pytest.mark.skipif(
    os.environ.get("QUANTREE_QAT_FULL") != "1",
    reason="the rest of the matrix: QUANTREE_QAT_FULL=1 runs it (~10 s more)",
)
MATRIX = [
    pytest.param(name, mode, id=f"{name}-{mode.value}", marks=() if fast else FULL)
    for name in CASES
    for mode in (WHOLE, CELLS)
    for fast in [
        (name, mode)
        in {
            ("lstm", WHOLE),
            ("lstm", CELLS),
            ("gru", WHOLE),
            ("gru", CELLS),
            ("rnn", CELLS),
            ("lstm-bidir-2layers", CELLS),
            ("gru-2layers", WHOLE),
            ("lstm-proj", WHOLE),
        }
    ]
]


@pytest.mark.parametrize(("name", "mode"), MATRIX)
def test_recurrent_qat_trains_and_converts(name: str, mode: qt.RecurrentMode) -> None:
    model, data, quantizer = _case(name, mode)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = qt.capture(model, data[0])
    prepared = qt.prepare(gm, quantizer)
    qt.calibrate(prepared, data, progress=False)
    ptq = qt.convert(prepared)
    qat = qt.prepare_qat(gm, quantizer, data)

    # untrained, QAT converts to exactly the post-training graph
    untrained = qt.convert(qat)
    assert [(n.op, n.target) for n in untrained.graph.nodes] == [
        (n.op, n.target) for n in ptq.graph.nodes
    ]
    with torch.no_grad():
        assert torch.equal(untrained(*data[1]), ptq(*data[1]))
        assert torch.equal(qat(*data[1]), ptq(*data[1]))

    losses, grads = _train(qat, data)
    assert losses[-1] < losses[0]
    learning = {f"{n}.scale" for n, m in fake_quant_modules(qat).items() if m.learning}
    scales = [n for n in grads if n in learning]
    weights = [n for n in grads if "weight" in n or n.split(".")[-1].startswith("w_")]
    assert scales and all(grads[n].abs().sum() > 0 for n in scales)
    assert weights and all(grads[n].abs().sum() > 0 for n in weights)
    if mode is CELLS:  # the fake quantization sits inside the step: gates, cell, hidden
        modules = fake_quant_modules(qat)
        assert any(".body." in n for n in modules)
        assert any(isinstance(m, FixedFakeQuant) for m in modules.values())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trained = qt.convert(qat)
    # a learned scale may leave a derived bias too fine a grid for int32: convert keeps that
    # bias float with one warning (core/grouping/overflow.py), never clamps it
    kept = _float_biases(trained)
    said = [str(w.message) for w in caught if "derived constant(s) float" in str(w.message)]
    assert bool(kept) == bool(said)
    if kept:
        assert _structure_without_constants(trained) == _structure_without_constants(ptq)
    else:
        assert [(n.op, n.target) for n in trained.graph.nodes] == [
            (n.op, n.target) for n in ptq.graph.nodes
        ]
    with torch.no_grad():
        assert torch.equal(trained(*data[2]), qat(*data[2]))
        assert not torch.equal(trained(*data[2]), ptq(*data[2]))
    for key, value in model.state_dict().items():  # the user's model is not trained
        assert torch.equal(value, before[key])


def _is_qdq(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and "quantized_decomposed" in str(node.target)


def _float_biases(gm: torch.fx.GraphModule) -> set[str]:
    """Biases a layer reads as float constants (no q/dq between them and the layer)."""
    return {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr"
        and "bias" in str(n.target)
        and n.users
        and not any(_is_qdq(u) for u in n.users)
    }


def _structure_without_constants(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    """(op, target) of every node but constants: a bias kept float is one ``get_attr``
    where a quantized one is its integers, scale, zero point and dequantize."""
    return [
        (n.op, n.target)
        for n in gm.graph.nodes
        if n.op != "get_attr"
        and not (_is_qdq(n) and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr")
    ]


@pytest.mark.parametrize("mode", [pytest.param(WHOLE, marks=FULL), CELLS], ids=["whole", "cells"])
def test_packed_sequences_train_and_convert(mode: qt.RecurrentMode) -> None:
    model, data, quantizer = _case("lstm", mode, packed=True)
    qat = qt.prepare_qat(qt.capture(model, data[0]), quantizer, data)
    losses, grads = _train(qat, data)
    assert losses[-1] < losses[0]
    learning = {f"{n}.scale" for n, m in fake_quant_modules(qat).items() if m.learning}
    read = [n for n in learning if n in grads]  # the returned (h_n, c_n) are never read
    assert read and all(grads[n].abs().sum() > 0 for n in read)
    ref = qt.convert(qat)
    with torch.no_grad():
        assert torch.equal(ref(*data[3]), qat(*data[3]))


def test_int16_state_and_fixed_gates_keep_their_grids() -> None:
    """The integer-LSTM recipe: the int16 cell state keeps its power-of-two scale and the
    fixed sigmoid/tanh parameters never move, while the int8 points learn; the converted
    graph holds the int16 state."""
    model, data, _ = _case("lstm", CELLS)
    quantizer = qt.Int8Quantizer(
        recurrent=CELLS, cell_state_dtype=qt.QDtype.INT16, gate_dtype=qt.QDtype.INT16
    )
    qat = qt.prepare_qat(qt.capture(model, data[0]), quantizer, data)
    modules = fake_quant_modules(qat).values()
    state = [m for m in modules if isinstance(m, LearnedFakeQuant) and m.spec.power_of_two]
    assert state and all(m.dtype is qt.QDtype.INT16 and not m.learning for m in state)
    fixed = [m for m in modules if isinstance(m, FixedFakeQuant)]
    assert fixed and not any(p.requires_grad for m in fixed for p in m.parameters())
    assert any(m.learning for m in modules)
    before = {id(m): m.qparams().scale.clone() for m in [*state, *fixed]}
    _train(qat, data, steps=2)
    for m in [*state, *fixed]:
        assert torch.equal(m.qparams().scale, before[id(m)])
    for m in state:
        assert torch.equal(m.qparams().scale, torch.exp2(torch.log2(m.qparams().scale).round()))
    ref = qt.convert(qat)
    assert any(torch.int16 in n.args for g in nested(ref) for n in g.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ref(*data[1]), qat(*data[1]))


def nested(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
