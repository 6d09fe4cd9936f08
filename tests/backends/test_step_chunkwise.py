"""xLSTM's chunkwise mLSTM step as one region program (``passes/instructions/region_math.py``,
``csrc/qt_program.h``: ``TRANSPOSE``, ``ROW_SUM``; ``cells/step_program.py``: ``narrow``
per-step inputs).

The step (transformers' ``mlstm_chunkwise_recurrent_fw_C``): ``m' = max(g + m, a_max)``,
``Kg = K * exp(a - m')[..., None]``, ``s = exp(g + m - m')``,
``C' = s[..., None, None] * C + Kg^T @ V``, ``n' = s[..., None] * n + Kg^T.sum(-1)``, its
``K`` and ``V`` chunks ``narrow``s of the whole sequence. Each op the step needed is checked
against ATen alone first; then the folded step of a small model written the same way."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends.cpu.cells import step_program
from quantree.backends.cpu.cells.step_program import NativeProgramLoop
from quantree.backends.cpu.passes.regions import fuse_regions
from quantree.recurrent.unrolled.step_loop import StepLoop

PROGRAM = torch.ops.quantree.program.default
FLOAT_BINARY, FLOAT_MATMUL, TRANSPOSE, ROW_SUM = 7, 14, 20, 21


def _one_program(module: nn.Module, ex: tuple[torch.Tensor, ...], views: int = 0):
    """``module`` exported and fused with the step math as a folded step is; its program's
    code. Every op of the graph is inside the program but ``views`` reshapes of an input."""
    gm = torch.export.export(module, ex).module()
    want = gm(*ex)
    step_program._simplify(gm)  # as a folded step's: unsqueezes as reshapes
    assert fuse_regions(gm, min_ops=1, math=True) == 1
    left = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert [t for t in left if "aten" in t] == ["aten.reshape.default"] * views
    call = next(n for n in gm.graph.nodes if n.target == PROGRAM)
    code = getattr(gm, str(call.args[2].target))  # type: ignore[union-attr]
    return gm, want, code, call


def test_max_of_two_tensors_in_a_program_gives_the_bits_of_aten_with_inf_and_nan():
    """``torch.max(a, b)`` (``aten.max.other``) is ``maximum``: NaN wins, -inf loses."""

    class Max(nn.Module):
        def forward(self, a, b):
            return torch.max(a + 0.5, b), torch.min(a, b * 2)

    a = torch.tensor([[float("-inf"), 1.0, float("nan"), -2.0], [0.0, 3.0, -1.0, 5.0]])
    b = torch.tensor([[0.25, float("-inf"), 1.0, float("nan")], [float("-inf")] * 4])
    gm, want, code, _ = _one_program(Max(), (a, b))
    kinds = [c[4] for c in code.tolist() if c[0] == FLOAT_BINARY]
    assert sorted(kinds) == [4, 5]  # maximum, minimum
    for got, ref in zip(gm(a, b), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)  # exact


def test_a_block_broadcast_operand_in_a_program_gives_the_bits_of_aten():
    """A ``[B, H, 1, 1]`` scale over ``[B, H, D, N]`` (xLSTM's ``s[..., None, None] * C``)
    and a ``[1, H, 1, 1]`` one, on either side: copied out to a column, one value per row."""

    class Block(nn.Module):
        def forward(self, s, c, t):  # [B, H], [B, H, D, N], [1, H, 1, 1]
            scale = s[..., None, None]
            return scale * c, c - scale, t + c * 2, (t - c) * scale

    ex = (torch.randn(2, 3), torch.randn(2, 3, 4, 5), torch.randn(1, 3, 1, 1))
    gm, want, code, _ = _one_program(Block(), ex)
    flags = [c[5] for c in code.tolist() if c[0] == FLOAT_BINARY]
    assert 1 in flags and 2 in flags  # a column on either side
    for got, ref in zip(gm(*ex), want, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("how", ["transpose", "permute", "mT"])
def test_a_transpose_of_the_last_two_dimensions_in_a_program_moves_the_exact_values(how):
    class Moved(nn.Module):
        def forward(self, k):  # [B, H, L, D]
            k = k * 1.5
            if how == "transpose":
                return k.transpose(-2, -1) + 1
            if how == "permute":
                return k.permute(0, 1, 3, 2) + 1
            return k.mT + 1

    ex = (torch.randn(2, 3, 5, 4),)
    gm, want, code, _ = _one_program(Moved(), ex)
    assert [c[3] for c in code.tolist() if c[0] == TRANSPOSE] == [5]  # R: rows per batch
    assert torch.equal(gm(*ex), want)


def test_a_transposed_operand_matmul_and_a_row_sum_in_a_program_match_aten_within_rounding():
    """``Kg^T @ V`` and ``Kg^T.sum(-1)`` (keepdim or not): the transpose a move (exact), the
    matmul summed in k order and the sum in double rounded once, so both equal ATen's up to
    float rounding (ATen's blocked, vectorized sums)."""

    class Update(nn.Module):
        def forward(self, k, v, a):  # [B, H, L, D], [B, H, L, N], [B, H, L]
            kg = k * torch.exp(a)[..., None]
            kt = kg.transpose(-2, -1)
            return kt @ v, kt.sum(-1), kg.sum(-1, keepdim=True)

    ex = (torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 12), torch.randn(1, 2, 16) * 0.5)
    gm, want, code, _ = _one_program(Update(), ex)
    ops = [c[0] for c in code.tolist()]
    assert ops.count(TRANSPOSE) == 1 and ops.count(FLOAT_MATMUL) == 1 and ops.count(ROW_SUM) == 2
    for got, ref in zip(gm(*ex), want, strict=True):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_tampered_transpose_or_row_sum_is_refused_with_a_quantree_error():
    class Update(nn.Module):
        def forward(self, k):
            kt = (k * 2).transpose(-2, -1)
            return kt.sum(-1), kt * 3

    ex = (torch.randn(2, 6, 4),)
    gm, _, code, call = _one_program(Update(), ex)
    rows = {c[0]: i for i, c in enumerate(code.tolist())}
    longer = int(code[rows[TRANSPOSE], 2])  # the transpose's source: 12 rows, not 8
    for op, field, value, says in [
        (TRANSPOSE, 3, 4, "shape is not"), (TRANSPOSE, 3, 0, "R out of range"),
        (ROW_SUM, 1, longer, "one value per row"),
    ]:  # fmt: skip
        tampered = code.clone()
        tampered[rows[op], field] = value
        setattr(gm, str(call.args[2].target), tampered)
        with pytest.raises(qt.QuantreeError, match=says):
            gm(*ex)


class ChunkwiseMLSTM(nn.Module):
    """transformers' ``mlstm_chunkwise_recurrent_fw_C`` over chunks of ``chunk`` steps,
    after int8 projections; returns the three buffers of received states."""

    def __init__(self, heads: int = 2, dqk: int = 4, dv: int = 6, chunk: int = 4) -> None:
        super().__init__()
        self.heads, self.dqk, self.dv, self.chunk = heads, dqk, dv, chunk
        self.k = nn.Linear(8, heads * dqk)
        self.v = nn.Linear(8, heads * dv)
        self.gates = nn.Linear(8, 2 * heads)

    def forward(self, x: torch.Tensor):  # [B, T, 8]
        b, t, _ = x.shape
        h, dqk, dv, chunk = self.heads, self.dqk, self.dv, self.chunk
        nc = t // chunk
        mat_k = self.k(x).reshape(b, t, h, dqk).transpose(1, 2)
        mat_v = self.v(x).reshape(b, t, h, dv).transpose(1, 2)
        i_gate, f_gate = self.gates(x).transpose(1, 2).chunk(2, dim=1)  # [B, H, T]
        vec_b = nn.functional.logsigmoid(f_gate).reshape(b, h, nc, chunk).cumsum(-1)
        vec_i = i_gate.reshape(b, h, nc, chunk)
        c_states = torch.zeros(b, h, (nc + 1) * dqk, dv)
        n_states = torch.zeros(b, h, (nc + 1) * dqk)
        m_states = torch.zeros(b, h, nc + 1)
        c_k, n_k, m_k = torch.zeros(b, h, dqk, dv), torch.zeros(b, h, dqk), torch.zeros(b, h)
        vec_a = vec_b[..., -1, None] - vec_b + vec_i
        sca_g = vec_b[..., -1]
        a_max = vec_a.max(-1).values
        for key in range(nc):
            c_states[:, :, key * dqk : (key + 1) * dqk, :] = c_k
            n_states[:, :, key * dqk : (key + 1) * dqk] = n_k
            m_states[:, :, key] = m_k
            g_k = sca_g[:, :, key]
            m_next = torch.max(g_k + m_k, a_max[:, :, key])
            k_chunk = mat_k[:, :, key * chunk : (key + 1) * chunk, :]
            v_chunk = mat_v[:, :, key * chunk : (key + 1) * chunk, :]
            a_bar = torch.exp(vec_a[:, :, key, :] - m_next[..., None])[:, :, :, None]
            k_gated = k_chunk * a_bar
            g_bar = torch.exp(g_k + m_k - m_next)[:, :, None]
            c_k = g_bar[..., None] * c_k + k_gated.transpose(-2, -1) @ v_chunk
            n_k = g_bar * n_k + k_gated.transpose(-2, -1).sum(-1)
            m_k = m_next
        c_states[:, :, -dqk:, :] = c_k
        n_states[:, :, -dqk:] = n_k
        m_states[:, :, -1] = m_k
        return c_states, n_states, m_states


def _quantized(model, x, fold, native=True, monkeypatch=None):
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(x.shape, generator=generator),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        if native:
            return qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=fold)
        with monkeypatch.context() as m:
            m.setattr(step_program, "fuse_regions", lambda *a, **k: 0)
            return qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=fold)


def test_the_folded_chunkwise_mlstm_step_is_one_native_program_equal_to_its_python_loop(
    monkeypatch,
):
    """4 chunks (fewer than the 8 steps a fold needs, but windows of the input: chunks),
    folded: the step is one program (the narrow K and V chunks its per-step inputs), with
    the transpose, the matmul, the row sum and the max inside it; the same values as the
    same lowered step run op by op in Python."""
    torch.manual_seed(0)
    model = ChunkwiseMLSTM().eval()
    x = torch.randn(1, 16, 8)
    native = _quantized(model, x, True)
    python = _quantized(model, x, True, native=False, monkeypatch=monkeypatch)
    (loop,) = [m for m in native.modules() if isinstance(m, (NativeProgramLoop, StepLoop))]
    assert type(loop) is NativeProgramLoop and loop.steps_captured == 4
    assert sorted(s.width for s in loop.inputs) == [0, 0, 0, 4, 4]  # K, V: chunks of 4
    ops = [c[0] for c in loop.code.tolist()]
    # K^T twice (for the matmul and for the sum: export keeps both transposes)
    assert ops.count(TRANSPOSE) == 2 and ops.count(ROW_SUM) == 1 and 13 in ops  # int8 MATMUL
    assert [type(m) for m in python.modules() if isinstance(m, StepLoop)] == [StepLoop]
    with torch.no_grad():
        for a, b in zip(native(x), python(x), strict=True):
            assert torch.equal(a, b)
        y = torch.randn(1, 16, 8)
        for a, b, ref in zip(native(y), python(y), model(y), strict=True):
            assert torch.equal(a, b)
            assert qt.sqnr(ref, a) > 20  # dB


def test_quantize_folds_the_chunkwise_step_by_default_once_it_is_one_program():
    torch.manual_seed(0)
    model = ChunkwiseMLSTM().eval()
    x = torch.randn(1, 16, 8)
    lowered = _quantized(model, x, None)
    assert [type(m) for m in lowered.modules() if "Loop" in type(m).__name__] == [NativeProgramLoop]
