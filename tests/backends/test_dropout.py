"""Eval-mode dropout is dropped at lowering (``passes/dropout.py``): it returns its input,
costs a call and cuts region programs; a training-mode dropout stays."""

from __future__ import annotations

import torch
from torch import fx, nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend
from quantree.backends.cpu.passes.dropout import drop_eval_dropout
from quantree.backends.cpu.saved.serialize import load, save

from support import calls

aten = torch.ops.aten


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.softmax(self.a(x), -1))
        return self.drop(self.b(y))


def _lowered(tmp_path=None):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g),) for _ in range(4)]
    torch.manual_seed(0)
    ref = qt.quantize(Dropped().eval(), data[0], data, progress=False, backend="reference")
    return ref, data


def test_eval_dropout_goes_with_the_same_bits_and_survives_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref, data = _lowered()
    assert len(calls(ref, aten.dropout.default)) == 2
    low = qt.lower(ref, CPU)
    original = cpu_backend.drop_eval_dropout
    cpu_backend.drop_eval_dropout = lambda gm: 0  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.drop_eval_dropout = original
    assert len(calls(plain, aten.dropout.default)) == 2
    assert calls(low, aten.dropout.default) == []
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = low(x)
        assert torch.equal(got, plain(x))
        assert qt.sqnr(ref(x), got) > 30  # int8 against the reference's simulation
        save(low, tmp_path / "m.pt2", data[0])
        loaded = load(tmp_path / "m.pt2")
        assert torch.equal(loaded(x), got)


def test_only_eval_mode_dropout_goes() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    kept = graph.call_function(aten.dropout.default, (x, 0.5, True))
    gone = graph.call_function(aten.dropout.default, (kept, 0.5, False))
    feature = graph.call_function(aten.feature_dropout.default, (gone,), {"p": 0.2, "train": False})
    graph.output(feature)
    gm = fx.GraphModule(nn.Module(), graph)
    assert drop_eval_dropout(gm) == 2
    (left,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert left is kept and list(kept.users) == [next(iter(gm.graph.nodes)).next.next]
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
