"""Mamba-2's chunked SSD in region programs (``passes/instructions/region_strided.py``,
``csrc/qt_program.h``: ``CUMSUM``, ``TRI_FILL``, ``STRIDED``; einsums as ``FLOAT_MATMUL``).

Each op is checked against ATen alone in a whole model's program (``top``): moves and
fills exactly, running sums exactly (summed in double, as ATen's CPU kernel), einsums to
float rounding. Then a Mamba-2 block written as transformers' ``mamba2_chunk_scan`` becomes
one program, and tampered instructions of each new opcode are refused at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends.cpu.passes.fold import fold_input_independent
from quantree.backends.cpu.passes.regions import fuse_regions

PROGRAM = torch.ops.quantree.program.default
FLOAT_MATMUL, CUMSUM, TRI_FILL, STRIDED = 14, 22, 23, 24


def _fused(module: nn.Module, ex: tuple[torch.Tensor, ...], programs: int = 1):
    """``module`` exported, its constant masks folded and fused as a whole model's graph
    is; every computing op inside ``programs`` programs. The first program's code."""
    gm = torch.export.export(module, ex).module()
    want = gm(*ex)
    fold_input_independent(gm)
    assert fuse_regions(gm, min_ops=1) == programs
    left = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    checks = "aten._assert_tensor_metadata.default"  # a .float() of a float32 parameter
    assert not [t for t in left if "aten" in t and t != checks], left
    call = next(n for n in gm.graph.nodes if n.target == PROGRAM)
    code = getattr(gm, str(call.args[2].target))  # type: ignore[union-attr]
    return gm, want, code, call


def _ops(code: torch.Tensor) -> list[int]:
    return [c[0] for c in code.tolist()]


def test_cumsum_along_the_last_two_dimensions_gives_the_bits_of_aten():
    class Sums(nn.Module):
        def forward(self, x):
            y = x * 1.5
            return y.cumsum(-1), y.cumsum(-2) + 1

    ex = (torch.randn(2, 3, 5, 7) * 100,)
    gm, want, code, _ = _fused(Sums(), ex)
    assert sorted(c[3] for c in code.tolist() if c[0] == CUMSUM) == [0, 5]  # rows; blocks of 5
    for got, ref in zip(gm(*ex), want, strict=True):
        assert torch.equal(got, ref)


def test_a_segment_sum_of_triangular_masks_gives_the_bits_of_aten():
    """transformers' ``segment_sum``: expand, ``masked_fill(~tril(-1), 0)``, cumsum over
    ``-2``, ``masked_fill(~tril(0), -inf)``, then exp; the masks become ``TRI_FILL``."""

    class Segsum(nn.Module):
        def forward(self, x):  # [..., T]
            t = x.size(-1)
            x = (x * 1.0)[..., None].expand(*x.size(), t)
            low = torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-1)
            x = x.masked_fill(~low, 0).cumsum(-2)
            keep = torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=0)
            return x.masked_fill(~keep, -torch.inf)

    ex = (torch.randn(2, 3, 6),)
    gm, want, code, _ = _fused(Segsum(), ex)
    fills = [(c[3], c[4]) for c in code.tolist() if c[0] == TRI_FILL]
    assert fills == [(6, -1), (6, 0)]  # j - i > k: ~tril(-1) and ~tril(0)
    assert STRIDED in _ops(code)  # the expand of the last dimension
    got = gm(*ex)
    assert torch.equal(got, want) and torch.isinf(got).any()


def test_moves_of_the_last_dimension_give_the_exact_values():
    """A permute that moves the last dimension, an expand of it, a select, a repeat of a
    size-1 dimension, a pad of the last dimension and a cat after zeros_like."""

    class Moves(nn.Module):
        def forward(self, x, c):  # [1, 4, 6, 3], [1, 5, 1, 2]
            x = x * 2
            p = x.permute(0, 3, 1, 2) + 1
            e = x[..., :1].expand(1, 4, 6, 5) - 1
            s = x.select(3, -1) * 3
            r = c.repeat_interleave(4, dim=2, output_size=4) + 2
            padded = F.pad(s, (1, 0)) * 1.5
            z = torch.cat([torch.zeros_like(x[:, :1]), x], dim=1) + 0.5
            return p, e, s, r, padded, z

    ex = (torch.randn(1, 4, 6, 3), torch.randn(1, 5, 1, 2))
    gm, want, code, _ = _fused(Moves(), ex)
    assert _ops(code).count(STRIDED) >= 3
    for got, ref in zip(gm(*ex), want, strict=True):
        assert got.shape == ref.shape and torch.equal(got, ref)


def test_last_two_dimensions_swapped_across_tile_edges_give_the_exact_values():
    """``TRANSPOSE`` and ``STRIDED``'s swap of the last two dimensions copy in 16 x 16 tiles:
    sizes that are not multiples of 16 (partial tiles on both edges), batched and not, and a
    permute whose last two dimensions are swapped under a moved batch dimension."""

    class Swaps(nn.Module):
        def forward(self, x, y):  # [1, 37, 21], [2, 19, 3, 35]
            t = (x * 2).transpose(-1, -2) + 1  # TRANSPOSE of one [37, 21] block
            b = (y * 3).permute(0, 2, 3, 1) - 1  # [2, 3, 35, 19]: stride 1 then 35 * 3
            c = (y + 1).permute(2, 0, 3, 1) * 0.5  # [3, 2, 35, 19], the batch moved too
            return t, b, c

    ex = (torch.randn(1, 37, 21), torch.randn(2, 19, 3, 35))
    gm, want, code, _ = _fused(Swaps(), ex)
    assert _ops(code).count(STRIDED) + _ops(code).count(20) >= 3
    for got, ref in zip(gm(*ex), want, strict=True):
        assert got.shape == ref.shape and torch.equal(got, ref)


@pytest.mark.parametrize(
    "equation, a, b",
    [
        ("bclhn,bcshn->bclsh", (1, 3, 4, 2, 5), (1, 3, 4, 2, 5)),
        ("bclsh,bcshp->bclhp", (1, 3, 4, 4, 2), (1, 3, 4, 2, 6)),
        ("bclhn,bclhp->bchpn", (1, 3, 4, 2, 5), (1, 3, 4, 2, 6)),
        ("bzch,bzhpn->bchpn", (1, 4, 4, 2), (1, 4, 2, 6, 5)),
        ("bclhn,bchpn->bclhp", (1, 3, 4, 2, 5), (1, 3, 2, 6, 5)),
        ("bhld,bhmd->bhlm", (2, 3, 5, 4), (2, 3, 7, 4)),  # a transposed operand: q k^T
    ],
)
def test_mamba2_einsums_as_batched_matmuls_match_aten_within_rounding(equation, a, b):
    class Einsum(nn.Module):
        def forward(self, x, y):
            return torch.einsum(equation, x * 1.0, y * 1.0)

    ex = (torch.randn(*a), torch.randn(*b))
    gm, want, code, _ = _fused(Einsum(), ex)
    assert _ops(code).count(FLOAT_MATMUL) == 1
    got = gm(*ex)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=0), -torch.inf)


class ChunkScan(nn.Module):
    """transformers' ``mamba2_chunk_scan`` (its reference path, copied: importing
    transformers here would pull torchvision), no initial state, length a multiple of the
    chunk (its pads are then of zero)."""

    def __init__(self, heads: int = 4, chunk: int = 8) -> None:
        super().__init__()
        self.chunk = chunk
        self.a_log = nn.Parameter(torch.randn(heads) * 0.5)
        self.d = nn.Parameter(torch.randn(heads))
        self.dt_bias = nn.Parameter(torch.randn(heads) * 0.1)

    def forward(self, x, dt, b, c):  # [1, T, H, P], [1, T, H], [1, T, 1, N] x 2
        batch, length, heads, _ = x.shape
        chunk = self.chunk
        a = -torch.exp(self.a_log.float())
        dt = torch.clamp(F.softplus(dt + self.dt_bias), 0.0, float("inf"))
        b = b.repeat_interleave(heads, dim=2, output_size=heads)
        c = c.repeat_interleave(heads, dim=2, output_size=heads)
        residual = self.d[..., None] * F.pad(x, (0, 0, 0, 0, 0, 0, 0, 0))
        x = x * dt[..., None]
        a = a * dt
        x, a, b, c = [t.reshape(batch, -1, chunk, *t.shape[2:]) for t in (x, a, b, c)]
        a = a.permute(0, 3, 1, 2)
        a_cumsum = torch.cumsum(a, dim=-1)
        big_l = torch.exp(_segment_sum(a))
        g = torch.einsum("bclhn,bcshn->bclsh", c, b)
        m = g * big_l.permute(0, 2, 3, 4, 1)
        y_diag = torch.einsum("bclsh,bcshp->bclhp", m, x)
        decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
        b_decay = b * decay_states.permute(0, -2, -1, 1)[..., None]
        states = torch.einsum("bclhn,bclhp->bchpn", b_decay, x)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))
        new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk.transpose(1, 3), states)
        states = new_states[:, :-1]
        c_states = torch.einsum("bclhn,bchpn->bclhp", c, states)
        y_off = c_states * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
        y = (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1])
        return (y + residual)[:, :length] * 1.0


def test_a_mamba2_chunk_scan_is_one_program_matching_aten_within_rounding():
    torch.manual_seed(0)
    t, heads, dim, state = 32, 4, 8, 8
    ex = (torch.randn(1, t, heads, dim), torch.randn(1, t, heads),
          torch.randn(1, t, 1, state), torch.randn(1, t, 1, state))  # fmt: skip
    gm, want, code, _ = _fused(ChunkScan(heads), ex)
    ops = _ops(code)
    assert ops.count(FLOAT_MATMUL) == 5 and CUMSUM in ops and TRI_FILL in ops
    torch.testing.assert_close(gm(*ex), want, rtol=1e-4, atol=1e-4)


def test_tampered_cumsum_tri_fill_and_strided_instructions_are_refused_at_load():
    class Ops(nn.Module):
        def forward(self, x):  # [2, 3, 4]
            t = x.size(-1)
            keep = torch.tril(torch.ones(t, t, dtype=torch.bool))
            y = (x * 2).cumsum(-2)[..., :1].expand(2, 3, 4)
            return y.masked_fill(~keep[:3], 0.0).permute(0, 2, 1) * 1.0

    ex = (torch.randn(2, 3, 4),)
    gm, _, code, call = _fused(Ops(), ex)
    rows = {c[0]: i for i, c in enumerate(code.tolist())}
    for op, field, value, says in [
        (CUMSUM, 3, 4, "whole number of blocks"),
        (CUMSUM, 3, -1, "block rows out of range"),
        (TRI_FILL, 3, 0, "block rows out of range"),
        (STRIDED, 9, 1 << 20, "reach past"),  # the stride of the 6 rows
        (STRIDED, 3, 0, "out of range"),
        (STRIDED, 6, 5, "does not hold"),
        (STRIDED, 1, int(code[rows[STRIDED], 2]), "dense owner"),
    ]:
        tampered = code.clone()
        tampered[rows[op], field] = value
        setattr(gm, str(call.args[2].target), tampered)
        with pytest.raises(qt.QuantreeError, match=says):
            gm(*ex)


def test_a_large_exp_runs_as_vector_rows_within_rounding_and_exp_of_minus_inf_is_zero():
    """An exp of more than ``region_math.VECTOR_EXP`` values (FLOAT_UNARY kind 12): within
    2e-7 relative of ATen's, 0 exactly where the input is -inf or below -87.3."""

    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x * 1.0)

    x = torch.randn(8, 40, 41) * 20
    x[0, 0, :5] = torch.tensor([-torch.inf, -87.4, -87.2, 88.0, 0.0])
    gm, want, code, _ = _fused(Exp(), (x,))
    assert [c[3] for c in code.tolist() if c[0] == 8] == [12]
    got = gm(x)
    assert torch.equal(got == 0, want == 0) or bool((got[want == 0] == 0).all())
    assert got[0, 0, 0] == 0 and got[0, 0, 1] == 0
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-37)


def test_a_large_softplus_runs_as_vector_rows_within_rounding():
    """A softplus of more than ``region_math.VECTOR_SOFTPLUS`` values (FLOAT_UNARY kind 13):
    within 1e-6 relative of ATen's over [-100, 40] (log1p's small values too) but for results
    under float's normal range (0 there, as kind 12's exp below -87.3), x itself above 20, 0
    for -inf, NaN for NaN; a smaller one keeps libm's kind (9: libm's exp and log1p)."""

    class Softplus(nn.Module):
        def forward(self, x):
            return nn.functional.softplus(x * 1.0)

    x = torch.linspace(-100.0, 40.0, 8 * 41 * 13).reshape(8, 41, 13)
    x[0, 0, :6] = torch.tensor([-torch.inf, torch.nan, 20.0, 20.5, -1e-8, 1e-8])
    gm, want, code, _ = _fused(Softplus(), (x,))
    assert [c[3] for c in code.tolist() if c[0] == 8] == [13]
    got = gm(x)
    assert got[0, 0, 0] == 0 and bool(got[0, 0, 1].isnan())
    assert torch.equal(got[x > 20], x[x > 20])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1.2e-38, equal_nan=True)
    small = torch.randn(4, 8, 16)
    gm, want, code, _ = _fused(Softplus(), (small,))
    assert [c[3] for c in code.tolist() if c[0] == 8] == [9]
    torch.testing.assert_close(gm(small), want, rtol=1e-6, atol=0.0)
