"""A region program's workspace and its float matmul (``csrc/qt_program.h``, ``program.cpp``).

Values whose instruction spans do not meet share workspace bytes (``program_lives``): a value
read long after it is made, a cat assembled piece by piece and a pad must still hold their
elements when read. ``FLOAT_MATMUL`` sums each element in k order (blocks of four rows, two
rows, one row and the last columns alike), so it equals that sum written with torch ops
exactly; its operands, copied by ``STRIDED`` in rows of 16 floats, keep their bits."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from quantree.backends.cpu.passes.fold import fold_input_independent
from quantree.backends.cpu.passes.regions import fuse_regions

PROGRAM = torch.ops.quantree.program.default
FLOAT_MATMUL, STRIDED = 14, 24


def _fused(module: nn.Module, ex: tuple[torch.Tensor, ...]):
    """``module`` exported and fused as a whole model's graph is, into exactly one program
    with no ATen op left; its outputs on ``ex`` before fusing, and the program's code."""
    gm = torch.export.export(module, ex).module()
    want = gm(*ex)
    fold_input_independent(gm)
    assert fuse_regions(gm, min_ops=1) == 1
    left = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in left if "aten" in t and "_assert" not in t], left
    call = next(n for n in gm.graph.nodes if n.target == PROGRAM)
    return gm, want, getattr(gm, str(call.args[2].target)).tolist()  # type: ignore[union-attr]


def test_values_read_long_after_they_are_made_survive_a_shared_workspace():
    """``early`` is read by the last op, after twelve values that die young; ``joined`` is a
    cat written piece by piece, ``padded`` a pad's border fill and copy: all exact."""

    class Chain(nn.Module):
        def forward(self, x, y):  # [64, 48] x 2
            early = x * 3.0
            z = y + 1.0
            for i in range(12):
                z = z * 0.5 + float(i)
            joined = torch.cat([z * 2.0, early - 1.0], dim=0)
            padded = F.pad(z * 1.5, (0, 0, 2, 1), value=7.0)
            return joined + 1.0, padded - 2.0, z + early

    torch.manual_seed(0)
    ex = (torch.randn(64, 48), torch.randn(64, 48))
    gm, want, code = _fused(Chain(), ex)
    assert len(code) >= 20
    for _ in range(2):  # the second call reuses the first's workspace as it left it
        for got, ref in zip(gm(*ex), want, strict=True):
            assert torch.equal(got, ref)


def _k_order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` ([..., M, K] @ [..., K, N]) summed in k order, each product and sum rounded
    to float32: the program's arithmetic, element by element."""
    acc = a[..., :, :1] * b[..., :1, :]
    for k in range(1, a.shape[-1]):
        acc = acc + a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return acc


def test_a_float_matmul_of_every_row_and_column_block_sums_in_k_order_exactly():
    """M = 11 (two blocks of four rows, a pair, a single row), N = 45 (two blocks of 16,
    one of 8, five single columns), K = 7, batched over 3."""

    class Product(nn.Module):
        def forward(self, x, y):
            return torch.einsum("bmk,bkn->bmn", x * 1.0, y * 1.0)

    torch.manual_seed(1)
    ex = (torch.randn(3, 11, 7), torch.randn(3, 7, 45))
    gm, want, code = _fused(Product(), ex)
    assert [c[0] for c in code].count(FLOAT_MATMUL) == 1
    got = gm(*ex)
    assert torch.equal(got, _k_order(ex[0] * 1.0, ex[1] * 1.0))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_operands_copied_in_rows_of_16_floats_keep_their_bits():
    """A chunked scan's ``C B^T`` per head: ``blhn,bshn->bhls`` with ``n = 16``, so both
    operands are ``STRIDED`` copies of 16-float rows (the constant-size row path)."""

    class Heads(nn.Module):
        def forward(self, c, b):  # [2, 9, 3, 16], [2, 10, 3, 16]
            return torch.einsum("blhn,bshn->bhls", c * 1.0, b * 1.0)

    torch.manual_seed(2)
    ex = (torch.randn(2, 9, 3, 16), torch.randn(2, 10, 3, 16))
    gm, want, code = _fused(Heads(), ex)
    torch.testing.assert_close(gm(*ex), want, rtol=1e-5, atol=1e-5)
    moves = [c for c in code if c[0] == STRIDED]
    assert any(c[6] == 16 and c[10] == 1 for c in moves)  # last size 16, stride 1
    c, b = (t * 1.0 for t in ex)
    ref = _k_order(c.permute(0, 2, 1, 3), b.permute(0, 2, 3, 1))
    assert torch.equal(gm(*ex), ref)


def test_rms_norm_rows_sum_their_squares_in_eight_double_partial_sums_exactly():
    """``RMS_NORM``: element j's square into partial sum j % 8 (in double, in order), the
    eight added pairwise, then ``x * (1 / sqrt(mean + eps)) * w`` in float32; rows of 133
    values (a 5-value tail), weighted and not."""

    class Norms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(133))

        def forward(self, x):
            y = x * 1.0
            return F.rms_norm(y, [133], self.w, 1e-5), F.rms_norm(y + 1.0, [133], None, 1e-6)

    def eight_sums(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        """Row by row in Python doubles and numpy float32 scalars (the same formula in torch
        ops gave one row's factor an ulp apart: its scalar ops round their own way)."""
        out = []
        for row in x.tolist():
            part = [0.0] * 8
            for j, v in enumerate(row):
                part[j % 8] += v * v
            total = ((part[0] + part[4]) + (part[1] + part[5])) + (
                (part[2] + part[6]) + (part[3] + part[7])
            )
            mean = np.float32(total / len(row)) + np.float32(eps)
            out.append(np.float32(1.0) / np.sqrt(mean))
        y = x * torch.tensor(out, dtype=torch.float32)[:, None]
        return y if w is None else w * y

    torch.manual_seed(3)
    module = Norms()
    ex = (torch.randn(6, 133) * 4,)
    gm, want, code = _fused(module, ex)
    assert [c[0] for c in code].count(11) == 2  # RMS_NORM
    got = gm(*ex)
    with torch.no_grad():
        assert torch.equal(got[0], eight_sums(ex[0] * 1.0, module.w, 1e-5))
        assert torch.equal(got[1], eight_sums(ex[0] * 1.0 + 1.0, None, 1e-6))
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)
