"""Tensors no input reaches are computed once at lowering (``lowering_fold``).

torchaudio's Emformer builds its attention mask from ``zeros``/``ones``/``cat`` on every call;
lowered, those ops now run once and the graph reads the result, with the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend

aten = torch.ops.aten


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 6, 8]
        rows = [torch.cat([torch.zeros(1, i), torch.ones(1, 6 - i)], 1) for i in range(6)]
        mask = (1 - torch.cat(rows, 0)).to(torch.bool)
        scores = self.proj(x) @ x.transpose(1, 2)
        return torch.softmax(scores.masked_fill(mask, -1e8), -1) @ x


def test_mask_built_every_call_is_folded_with_the_same_bits() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 6, 8, generator=g),) for _ in range(4)]
    ref = qt.quantize(Masked().eval(), data[0], data, progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    original = cpu_backend.fold_input_independent, cpu_backend.compute_once_per_shape
    cpu_backend.fold_input_independent = lambda gm: 0  # type: ignore[assignment]
    # (the mask reads no input, so the per-shape pass would take it when nothing folds it)
    cpu_backend.compute_once_per_shape = lambda gm: gm  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.fold_input_independent, cpu_backend.compute_once_per_shape = original
    made = {aten.zeros.default, aten.ones.default, aten.cat.default, aten.rsub.Scalar}
    assert made & {n.target for n in plain.graph.nodes}
    assert not made & {n.target for n in low.graph.nodes}
    with torch.no_grad():
        for batch in (2, 3):  # the batch stays dynamic: only the mask is constant
            x = torch.randn(batch, 6, 8, generator=g)
            assert torch.equal(low(x), plain(x))
    assert ref.graph is not low.graph and made & {n.target for n in ref.graph.nodes}


class ReturnsConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(x), torch.cat([torch.zeros(2), torch.ones(2)]) * 2


def test_a_returned_tensor_is_not_a_stored_constant() -> None:
    """The caller may write to what the model returns: that must not change the next call."""
    torch.manual_seed(0)
    data = [(torch.randn(2, 8),) for _ in range(3)]
    low = qt.quantize(ReturnsConstant().eval(), data[0], data, backend=CPU, progress=False)
    with torch.no_grad():
        _, first = low(*data[0])
        first.add_(100)
        _, second = low(*data[0])
    assert torch.equal(second, torch.tensor([0.0, 0.0, 2.0, 2.0]))


class Rotary(nn.Module):
    """A rotary table computed under ``torch.no_grad()`` from positions and a buffer, as
    Hugging Face's LLaMA does: export wraps the block in ``wrap_with_set_grad_enabled``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 0.5 ** torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 6, 8]
        with torch.no_grad():
            angles = torch.arange(6, dtype=torch.float32)[:, None] * self.inv_freq[None]
            angles = torch.cat((angles, angles), -1)
        return self.proj(x) * angles.cos() + x * angles.sin()


def test_a_no_grad_block_on_constants_is_folded_with_the_same_bits() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 6, 8, generator=g),) for _ in range(4)]
    ref = qt.quantize(Rotary().eval(), data[0], data, progress=False, backend="reference")
    region = torch.ops.higher_order.wrap_with_set_grad_enabled
    assert region in {n.target for n in ref.graph.nodes}
    low = qt.lower(ref, CPU)
    original = cpu_backend.fold_input_independent
    cpu_backend.fold_input_independent = lambda gm: 0  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.fold_input_independent = original
    assert region in {n.target for n in plain.graph.nodes}
    assert region not in {n.target for n in low.graph.nodes}
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 6, 8, generator=g)
            assert torch.equal(low(x), plain(x))


class PositionBias(nn.Module):
    """T5's relative position bias: buckets from ``arange``s, shifted in place with ``add_``,
    looked up in an embedding table: no input reaches any of it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.bias = nn.Embedding(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 6, 8]
        buckets = (torch.arange(6)[None, :] - torch.arange(6)[:, None]) * 1
        buckets.add_(torch.full((6, 6), 6))  # as T5's ``relative_buckets +=``
        scores = self.proj(x) @ x.transpose(1, 2)
        return torch.softmax(scores + self.bias(buckets)[..., 0], -1) @ x


def test_an_in_place_op_on_a_temporary_no_longer_stops_folding() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 6, 8, generator=g),) for _ in range(4)]
    ref = qt.quantize(PositionBias().eval(), data[0], data, progress=False, backend="reference")
    assert aten.add_.Tensor in {n.target for n in ref.graph.nodes}
    low = qt.lower(ref, CPU)
    original = cpu_backend.fold_input_independent
    cpu_backend.fold_input_independent = lambda gm: 0  # type: ignore[assignment]
    try:
        plain = qt.lower(ref, CPU)
    finally:
        cpu_backend.fold_input_independent = original
    lookup = torch.ops.quantree.embedding_rows.default
    assert {aten.add_.Tensor, lookup} <= {n.target for n in plain.graph.nodes}
    assert not {aten.add_.Tensor, lookup} & {n.target for n in low.graph.nodes}
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 6, 8, generator=g)
            assert torch.equal(low(x), plain(x))
