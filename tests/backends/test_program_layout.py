"""An attention block's layout changes run inside region programs (``program_layout``).

LLaMA's attention views a projection ``[B, S, H * D]`` as ``[B, S, H, D]``, transposes it
to ``[B, H, S, D]``, applies the rotary embedding (tables ``[S, D]`` broadcast over heads;
``rotate_half`` is two column slices, a ``neg`` and a ``cat``), expands grouped key/value
heads, and after attention transposes and merges back. In a program each transpose,
broadcast and expand is a row copy and each view of dense rows a new view of the same
bytes, and ``mul``/``add``/``neg`` are the same float32 operations as ATen's: the program
equals the unfused lowered graph bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu import backend as cpu_backend
from quantree.backends.cpu.cells.program import Program
from quantree.backends.cpu.passes.instructions.region_layout import gather, reshape, row_map

from support import calls

aten = torch.ops.aten
PROGRAM = torch.ops.quantree.program.default
LAYOUT = {aten.transpose.int, aten.expand.default, aten.neg.default, aten.cat.default}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with a rotary embedding, as Hugging Face's LLaMA writes it
    (no norms: every float op here is exact, so fused and unfused must be equal)."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        angles = torch.arange(seq)[:, None] * (0.5 ** torch.arange(self.dim // 2))[None]
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos()[None, None])  # [1, 1, S, D]
        self.register_buffer("sin", angles.sin()[None, None])

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.dim).transpose(1, 2)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        b, h, s, d = x.shape
        n = self.heads // self.kv_heads
        return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, W]
        q, k = self._heads(self.q(x), self.heads), self._heads(self.k(x), self.kv_heads)
        v = self._heads(self.v(x), self.kv_heads)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        out = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _lowered(dynamic_batch: bool, batch: int = 1) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 8, 32, generator=g),) for _ in range(4)]
    ref = qt.quantize(
        Blocks().eval(),
        data[0],
        data,
        dynamic_batch=dynamic_batch,
        progress=False,
        backend="reference",
    )
    original = cpu_backend.fuse_regions
    cpu_backend.fuse_regions = lambda gm: 0  # type: ignore[assignment]
    try:
        unfused = qt.lower(ref, CPU)
    finally:
        cpu_backend.fuse_regions = original
    return ref, unfused, qt.lower(ref, CPU)


def test_attention_layout_runs_in_programs_with_the_same_bits(tmp_path) -> None:
    _, unfused, low = _lowered(dynamic_batch=False)
    assert {n.target for n in unfused.graph.nodes} >= LAYOUT
    # the tail after the last attention (transpose, reshape, linear, add) is too short for a
    # program (MIN_OPS): two programs, before and between the attentions
    assert len(calls(low, PROGRAM)) == 2
    assert len(calls(low, aten.transpose.int)) == 1
    assert not {aten.expand.default, aten.neg.default, aten.cat.default} & {
        n.target for n in low.graph.nodes
    }
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = unfused(x)
        assert torch.equal(low(x), want)
        save(low, tmp_path / "m.pt2", (x,))
        assert torch.equal(load(tmp_path / "m.pt2")(x), want)


def test_a_dynamic_batch_keeps_the_same_bits() -> None:
    """A symbolic batch: transposes across it stay ATen's (``row_map`` needs fixed sizes,
    and here what is left between them is too short for a program): every batch size still
    equals the unfused graph."""
    _, unfused, low = _lowered(dynamic_batch=True, batch=2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 8, 32, generator=g)
            assert torch.equal(low(x), unfused(x))


def _run(p: Program, source: torch.Tensor, out: int, rows: int) -> torch.Tensor:
    """Run ``p`` with ``source`` (dense float rows) in slot 0; slot ``out`` comes back."""
    ops = torch.ops.quantree
    cols = p.slots[out][3]
    (got,) = ops.program(
        [source], [], torch.tensor(p.code, dtype=torch.int64).reshape(-1, 12),
        torch.tensor(p.fcode, dtype=torch.float32).reshape(-1, 8),
        torch.tensor(p.slots, dtype=torch.int64), torch.tensor([0]), torch.tensor([out]),
        list(source.shape), [2], [rows, cols], [2], [0],
    )  # fmt: skip
    return got


def test_row_copies_equal_torch_permute_expand_and_reshape() -> None:
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    for perm in ([0, 2, 1, 3], [2, 0, 1, 3], [1, 2, 0, 3]):
        p = Program()
        p.slots.append([0, 0, 0, 5, 5, 24])
        dims = row_map(tuple(x.shape), tuple(x.permute(perm).shape), perm)
        assert dims is not None
        out = gather(p, 0, dims)
        got = _run(p, x.reshape(24, 5), out, 24)
        assert torch.equal(got, x.permute(perm).reshape(24, 5)), perm
    p = Program()
    p.slots.append([0, 0, 0, 5, 5, 3])
    y = x[:1, :, :1].expand(2, 3, 4, 5)  # a leading and an inner broadcast
    dims = row_map((1, 3, 1, 5), (2, 3, 4, 5), None)
    assert dims is not None
    got = _run(p, x[:1, :, :1].reshape(3, 5).contiguous(), gather(p, 0, dims), 24)
    assert torch.equal(got, y.reshape(24, 5))
    assert row_map((3, 5), (3, 6), None) is None  # the last dimension never moves
    p = Program()
    p.slots.append([0, 0, 0, 6, 6, 4])
    narrow = len(p.slots)
    p.slots.append([0, 0, 4, 4, 6, 4])  # columns 1..4 of each row: not dense
    got = _run(p, torch.arange(24.0).reshape(4, 6), reshape(p, narrow, 8, 2), 8)
    assert torch.equal(got, torch.arange(24.0).reshape(4, 6)[:, 1:5].reshape(8, 2))
