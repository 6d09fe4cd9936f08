"""Embeddings read an int8 table by gathering rows first: bit-equal to the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.checks import NativeArgumentError

from support import calls, qd


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 24)
        self.out = nn.Linear(24, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def _ids(n: int = 6) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 500, (2, 11), generator=g),) for _ in range(n)]


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-row", "per-tensor"])
def test_embedding_gathers_int8_rows_and_equals_the_reference(per_channel: bool) -> None:
    data = _ids()
    quantizer = qt.Int8Quantizer(per_channel=per_channel)
    ref = qt.quantize(
        Tagger().eval(), data[0], data, quantizer=quantizer, progress=False, backend="reference"
    )
    low = qt.lower(ref, CPU)
    assert len(calls(low, torch.ops.quantree.embedding_rows.default)) == 1
    assert not calls(low, torch.ops.aten.embedding.default)
    dq = (qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default)
    tables = [n for n in low.graph.nodes if n.target in dq and n.args[0].op == "get_attr"]
    assert not tables  # the whole table is never dequantized
    with torch.no_grad():
        for (ids,) in data:
            emb_ref = [n for n in ref.graph.nodes if n.target == torch.ops.aten.embedding.default]
            assert emb_ref
            assert torch.equal(ref(ids), low(ids))


def test_lowered_embedding_saves_and_loads(tmp_path) -> None:
    data = _ids(3)
    low = qt.quantize(Tagger().eval(), data[0], data, backend=CPU, progress=False)
    save(low, tmp_path / "tagger.pt2", data[0])
    loaded = load(tmp_path / "tagger.pt2")
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), low(*data[1]))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16])
def test_native_row_gather_is_bit_equal_to_the_aten_ops(dtype: torch.dtype) -> None:
    """The per-row lookup runs natively (one call; an int16 table too, the default for a
    transformer's token table, which the ATen fallback made twice as slow as an int8 one);
    its bits are the five ATen ops' it replaced, and an index out of range raises as
    ``embedding`` does."""
    from quantree.backends.cpu.ops.embedding import embedding_rows, native_rows

    g = torch.Generator().manual_seed(0)
    info = torch.iinfo(dtype)
    table = torch.randint(info.min, info.max + 1, (300, 37), dtype=dtype, generator=g)
    scale = torch.rand(300, generator=g) * 0.1 + 1e-4
    zero_point = torch.randint(-128, 128, (300,), dtype=torch.int32, generator=g)
    assert native_rows(table, scale, zero_point, torch.zeros(2, dtype=torch.int64))
    for shape in [(), (5,), (2, 11), (3, 1, 4)]:
        ids = torch.randint(0, 300, shape, generator=g)
        rows = torch.nn.functional.embedding(ids, table)
        want = (rows - zero_point[ids].unsqueeze(-1)) * scale[ids].unsqueeze(-1)
        got = embedding_rows(table, scale, zero_point, ids, True)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    for bad in (300, -1):
        # an index out of range is a clean error naming the op (torch's IndexError beneath)
        with pytest.raises(NativeArgumentError, match=r"quantree\.embedding_rows: .*IndexError"):
            embedding_rows(table, scale, zero_point, torch.tensor([[3, bad]]), True)
