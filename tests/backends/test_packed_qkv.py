"""``nn.MultiheadAttention``'s packed q/k/v split becomes three column slices
(``lowering_packed_qkv``): the same values, fewer ops, and a program can run it."""

from __future__ import annotations

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu import backend as cpu_backend

aten = torch.ops.aten


def _lower(ref, split: bool = True, fuse: bool = True):
    saved = cpu_backend.split_packed_qkv, cpu_backend.fuse_regions
    if not split:
        cpu_backend.split_packed_qkv = lambda gm: 0  # type: ignore[assignment]
    if not fuse:
        cpu_backend.fuse_regions = lambda gm: 0  # type: ignore[assignment]
    try:
        return qt.lower(ref, CPU)
    finally:
        cpu_backend.split_packed_qkv, cpu_backend.fuse_regions = saved


def test_packed_split_is_column_slices_with_the_same_bits() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(1, 10, 32, generator=g),) for _ in range(4)]
    ref = qt.quantize(layer, data[0], data, progress=False, backend="reference")
    split, kept = _lower(ref, fuse=False), _lower(ref, split=False, fuse=False)
    assert aten.unflatten.int in {n.target for n in kept.graph.nodes}
    assert aten.unflatten.int not in {n.target for n in split.graph.nodes}
    assert aten.unflatten.int in {n.target for n in ref.graph.nodes}  # the reference as it was
    with torch.no_grad():
        for (x,) in data:
            assert torch.equal(split(x), kept(x))
