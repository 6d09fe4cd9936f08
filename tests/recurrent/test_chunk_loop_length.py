"""A Python ``for`` over ``T // chunk`` windows (xLSTM's chunkwise mLSTM), unrolled by
``torch.export``, folds into one loop freed of its length: the captured integers become the
input's size over the chunk, the graph checks the size is a multiple of the chunk, and says
which length it cannot run (``recurrent/unrolled/free.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import quantree as qt
from quantree.backends.fastest import reference_of
from quantree.recurrent.unrolled.step_loop import StepLoop
from quantree.recurrent.unrolled.symbolic import length_symbol, symbolic_val


class ChunkScan(nn.Module):
    """A decayed linear recurrence over chunks of ``chunk`` steps, written as xLSTM's
    ``mlstm_chunkwise_recurrent_fw_C``: a Python loop over ``T // chunk`` windows of the
    projections, per-chunk gates from a ``[B, H, nc, chunk]`` view, the carried state written
    to a ``[B, H, (nc + 1) D, E]`` buffer slice by slice, and the inter-chunk result used by
    elementwise math over the whole sequence after the loop."""

    def __init__(
        self, chunk: int, heads: int = 2, d: int = 3, e: int = 4, saveable: bool = False
    ) -> None:
        super().__init__()
        self.chunk, self.heads, self.d, self.e = chunk, heads, d, e
        self.saveable = saveable  # log(sigmoid): log_sigmoid is not in the saved vocabulary
        self.k = nn.Linear(5, heads * d)
        self.v = nn.Linear(5, heads * e)
        self.gate = nn.Linear(5, heads)
        self.out = nn.Linear(heads * e, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T, 5]
        b, t, _ = x.shape
        h, d, e, chunk = self.heads, self.d, self.e, self.chunk
        nc = t // chunk
        k = self.k(x).reshape(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        v = self.v(x).reshape(b, t, h, e).transpose(1, 2)
        gate = self.gate(x)
        log_gate = gate.sigmoid().log() if self.saveable else nn.functional.logsigmoid(gate)
        g = log_gate.transpose(1, 2).reshape(b, h, nc, chunk)
        decay = g.sum(-1).exp()  # [B, H, nc]
        states = torch.zeros(b, h, (nc + 1) * d, e)
        c = torch.zeros(b, h, d, e)
        for key in range(nc):
            states[:, :, key * d : (key + 1) * d, :] = c
            kc = k[:, :, key * chunk : (key + 1) * chunk, :]
            vc = v[:, :, key * chunk : (key + 1) * chunk, :]
            c = decay[:, :, key, None, None] * c + kc.transpose(-2, -1) @ vc
        states[:, :, -d:, :] = c
        y = (v * g.reshape(b, h, t).exp()[..., None]).transpose(1, 2).reshape(b, t, h * e)
        return self.out(y), states


def _capture(model: nn.Module, x: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        return qt.capture(model, (x,), fold_loops=True)


@pytest.mark.parametrize(("chunk", "steps"), [(4, 4), (3, 5), (2, 8), (5, 4)])
def test_a_chunk_loop_captured_at_one_length_runs_exactly_at_every_multiple_of_its_chunk(
    chunk, steps
):
    """Folded and freed: the graph equals the float model bit for bit at lengths shorter,
    equal and longer than the captured one (multiples of the chunk), batch 1 and 2."""
    torch.manual_seed(chunk * 10 + steps)
    model = ChunkScan(chunk).eval()
    gm = _capture(model, torch.randn(1, chunk * steps, 5))
    (loop,) = [m for m in gm.modules() if isinstance(m, StepLoop)]
    assert loop.free and loop.steps_captured == steps
    generator = torch.Generator().manual_seed(steps)
    for n in sorted({1, 2, steps, steps + 1, 3 * steps + 2}):
        x = torch.randn(1, n * chunk, 5, generator=generator)
        with torch.no_grad():
            got, want = gm(x), model(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), n


def test_a_length_that_is_not_a_multiple_of_the_chunk_is_refused_naming_guard_length_and_fix():
    model = ChunkScan(4).eval()
    gm = _capture(model, torch.randn(1, 16, 5))
    for length in (17, 6):
        with pytest.raises(RuntimeError) as error:
            gm(torch.randn(1, length, 5))
        said = str(error.value)
        assert "length % 4 == 0" in said and "captured at 16" in said, said
        assert "dimension 1" in said and "capture (quantize) at the length" in said, said


def test_a_quantized_chunk_loop_runs_at_other_lengths_as_its_reference_graph():
    """Lowered for the CPU backend from a 16-step capture: at 8 and 40 steps it follows its
    own reference graph (30 dB; the reference and the lowered loop compute the same grid)."""
    torch.manual_seed(0)
    model = ChunkScan(4).eval()
    x = torch.randn(1, 16, 5)
    data = [(torch.randn(1, 16, 5),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        low = qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=True)
    reference = reference_of(low)
    assert reference is not None
    for length in (8, 40):
        y = torch.randn(1, length, 5)
        with torch.no_grad():
            got, want = low(y), reference(y)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and qt.sqnr(b, a) > 30, length
    with pytest.raises(RuntimeError, match="length % 4 == 0"):
        low(torch.randn(1, 18, 5))


def test_a_freed_value_keeps_the_captured_strides_with_the_length_in_them():
    """``symbolic_val`` of a transposed ``[B, T, D] -> [B, D, T]`` value (strides
    ``(T D, 1, D)``): the strides follow the length symbol; the layout is not made
    contiguous. A contiguous value stays contiguous."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        val = torch.empty(2, 16, 3).transpose(1, 2)  # [2, 3, 16], strides (48, 1, 3)
        longer = torch.empty(2, 17, 3).transpose(1, 2)
        dense, dense2 = torch.empty(2, 3, 16), torch.empty(2, 3, 17)
    node = torch.fx.Graph().placeholder("x")
    node.meta["val"] = val
    symbol = length_symbol([node], 16)
    assert symbol is not None
    s = symbol.node.expr
    got = symbolic_val(val, longer, symbol, 16)
    assert [_hint(x) for x in got.stride()] == [48, 1, 3]
    assert got.stride()[0].node.expr == 3 * s and got.shape[2].node.expr == s
    got = symbolic_val(dense, dense2, symbol, 16)
    assert [_hint(x) for x in got.stride()] == [48, 16, 1] and got.stride()[1].node.expr == s


def _hint(size: int | torch.SymInt) -> int:
    """The example value of a size, without ``int()``'s guard (which pins the symbol)."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def test_a_chunk_loop_keeps_its_captured_length_unless_freeing_chunks_is_asked():
    """``free_chunks=False`` (``quantize``'s default trial: the captured length's speed) keeps
    the chunk loop at its 4 captured chunks and says so once; ``True`` frees it."""
    model = ChunkScan(4).eval()
    x = torch.randn(1, 16, 5)
    with pytest.warns(qt.QuantreeWarning, match="fold_loops=True"):
        fixed = qt.capture(model, (x,), fold_loops=True, free_chunks=False, dynamic_batch=False)
    freed = qt.capture(model, (x,), fold_loops=True, free_chunks=True, dynamic_batch=False)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(fixed(x), model(x), strict=True))
        y = torch.randn(1, 32, 5)
        assert all(torch.equal(a, b) for a, b in zip(freed(y), model(y), strict=True))
        with pytest.raises(Exception):  # noqa: B017 (export's own shape guard)
            fixed(y)


def test_a_saved_freed_chunk_loop_runs_at_other_multiples_after_load(tmp_path):
    """``save`` re-exports the lowered model: the freed sizes and the chunk check go with it,
    so the loaded model gives the lowered model's bits at 8, 16 and 32 steps (captured at 16)
    and refuses 17."""
    from quantree.backends import load, save

    torch.manual_seed(0)
    model = ChunkScan(4, saveable=True).eval()
    x = torch.randn(1, 16, 5)
    data = [(torch.randn(1, 16, 5),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        low = qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=True)
    save(low, tmp_path / "chunks.pt2", (x,))
    back = load(tmp_path / "chunks.pt2")
    for length in (8, 16, 32):
        y = torch.randn(1, length, 5)
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(back(y), low(y), strict=True)), length
    with pytest.raises(Exception, match="% 4 == 0"):
        back(torch.randn(1, 17, 5))


def test_a_call_at_another_length_names_the_loop_and_following_the_fix_runs_it():
    """The model's own loop fixes the length, so ``dynamic_shapes`` (the generic fix) would
    not free it: the error names the loop and ``fold_loops=True``, which does."""
    torch.manual_seed(3)
    model = ChunkScan(4, saveable=True).eval()
    data = [(torch.randn(1, 16, 5),) for _ in range(3)]
    longer = torch.randn(1, 20, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        pinned = qt.quantize(model, data[0], data, progress=False)
        with pytest.raises(qt.QuantreeError) as raised:
            pinned(longer)
        text = str(raised.value)
        assert "dimension 1 was fixed at capture" in text
        assert "4 chunks of 4" in text and "fold_loops=True" in text
        assert "dynamic_shapes=" not in text  # the advice that would not work
        freed = qt.quantize(model, data[0], data, progress=False, fold_loops=True)
        with torch.no_grad():
            got, want = freed(longer), model(longer)
    assert got[0].shape == want[0].shape == (1, 20, 5)
    assert qt.sqnr(want[0], got[0]) > 20


def test_a_dimension_captured_dynamic_that_the_code_constrains_is_not_sent_back_to_dynamic():
    """Captured with ``dynamic_shapes``, the loop still guards ``T // 4 == 4``: the error said
    to capture dynamic, which the user had done."""
    model = ChunkScan(4, saveable=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        gm = qt.capture(
            model, (torch.randn(1, 16, 5),), dynamic_shapes={"x": {1: torch.export.Dim.AUTO}}
        )
    with pytest.raises(qt.QuantreeError) as raised:
        gm(torch.randn(1, 20, 5))
    text = str(raised.value)
    assert "dimension 1 (size 20) was captured dynamic, but the model's code constrains it" in text
    assert "dynamic_shapes=" not in text
    assert gm(torch.randn(1, 16, 5))[0].shape == (1, 16, 5)  # a size the condition allows
