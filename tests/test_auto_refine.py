"""qt.quantize refines by default where the graph is transformer-like, and nowhere else.

Thresholds: on the transformer-like block below (int16 inputs, int8 weights: the weights'
rounding is the error left) the default's SQNR on new inputs is at least 1 dB above the
unrefined model's (measured 76.4 against 67.6 dB); the default equals an explicit ``Refine()``
exactly. A CNN, an iterator and a process group are left as convert made them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.refining.refine import REFINED_KEY
from quantree.pipeline import auto_refine


class Block(nn.Module):
    """A pre-norm feed-forward block on correlated features (a transformer's layer)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _block_data(n: int, seed: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(8, 32, generator=torch.Generator().manual_seed(7))
    return [(torch.randn(64, 8, generator=g) @ mix + 0.1 * torch.randn(64, 32, generator=g),)
            for _ in range(n)]  # fmt: skip


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()


def _quantize(model: nn.Module, data, **kwargs) -> torch.fx.GraphModule:
    return qt.quantize(model, data[0], data, progress=False, backend="reference", **kwargs)


def _sqnr(model: nn.Module, quantized: torch.nn.Module, held) -> float:
    with torch.no_grad():
        want = torch.cat([model(*x) for x in held])
        got = torch.cat([quantized(*x) for x in held])
    return float(qt.sqnr(want, got))


def test_a_transformer_like_graph_is_refined_by_default():
    torch.manual_seed(0)
    model, data, held = Block().eval(), _block_data(16, 1), _block_data(4, 2)
    default = _quantize(model, data)
    explicit = _quantize(model, data, refine=qt.Refine())
    never = _quantize(model, data, refine=None)
    assert [r.node for r in default.meta[REFINED_KEY]] == ["linear", "linear_1"]
    assert REFINED_KEY not in never.meta
    with torch.no_grad():
        for x in held:
            assert torch.equal(default(*x), explicit(*x))
    assert _sqnr(model, default, held) >= _sqnr(model, never, held) + 1.0


def test_a_cnn_an_iterator_and_a_process_group_are_not_refined_by_default(monkeypatch):
    model = _cnn()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 8, 8, generator=g),) for _ in range(4)]
    assert REFINED_KEY not in _quantize(model, data).meta
    block, blocks = Block().eval(), _block_data(4, 1)
    captured = qt.capture(block, blocks[0])
    assert auto_refine(captured, blocks) == qt.Refine()
    assert auto_refine(captured, iter(blocks)) is None  # run once only: nothing to refine on
    from_iterator = qt.quantize(block, blocks[0], iter(blocks), progress=False, backend=None)
    assert REFINED_KEY not in from_iterator.meta
    monkeypatch.setattr("quantree.pipeline.in_process_group", lambda: True)
    assert auto_refine(captured, blocks) is None  # a shard's integers would differ per process


def test_refine_takes_a_refine_none_or_auto_only():
    block, blocks = Block().eval(), _block_data(2, 1)
    with pytest.raises(qt.QuantreeError, match=r"a quantree\.Refine, None or 'auto'"):
        _quantize(block, blocks, refine=True)
    with pytest.raises(qt.QuantreeError, match="collection it can run again"):
        qt.quantize(block, blocks[0], iter(blocks), refine=qt.Refine(), progress=False)
