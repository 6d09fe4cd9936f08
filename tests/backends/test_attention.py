"""Float attention blocks run as one native call (``passes/attention.py``, ``quantree.attention``).

The default recipe keeps attention's scores, softmax and weighted sum float, so the fused
call must compute what the reference graph's float ops compute: the bound everywhere is
float rounding, ``|got - want| <= 1e-5 + 1e-4 |want|`` (the kernels sum the products of a
dot product in another order than ATen's matmul), and the lowered model's output is within
that of the model lowered without the fusion.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import quantree as qt
import quantree.backends.cpu.passes.regions as regions
from quantree.backends import CPU, cpu_backend, load, save
from quantree.backends.cpu.native import program_checks
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.loader import ISA_NAMES, isa_cap, library
from quantree.tools.inspection import NATIVE_FLOAT, op_statuses
from quantree.tools.metrics import sqnr

from support import calls

aten = torch.ops.aten
ATTENTION = torch.ops.quantree.attention.default
ATOL, RTOL = 1e-5, 1e-4


def reference(q, k, v, mask, scale):
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, -1), v)


@pytest.fixture(params=["portable", "avx2", "avx512vnni"])
def path(request):
    lib = library()
    if lib.qt_select_isa(ISA_NAMES.index(request.param)) != ISA_NAMES.index(request.param):
        lib.qt_select_isa(isa_cap())
        pytest.skip(f"this CPU has no {request.param} path")
    yield request.param
    lib.qt_select_isa(isa_cap())


SHAPES = [  # B, H, Sq, Sk, D, Dv: BERT's, and sizes off every block of the AVX-512 and AVX2 paths
    (1, 2, 128, 128, 64, 64),
    (2, 3, 7, 19, 5, 33),
    (3, 1, 1, 1, 1, 1),
    (2, 4, 17, 70, 48, 80),
    (1, 1, 5, 0, 4, 4),  # no keys: the reference's empty softmax makes zeros
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("heads_last", [False, True])
def test_the_op_is_the_reference_formula(path, shape, heads_last) -> None:
    b, h, sq, sk, d, dv = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g).transpose(1, 2)  # strided, as heads are split
    k = torch.randn(b, h, sk, d, generator=g)
    v = torch.randn(b, sk, h, dv, generator=g).transpose(1, 2)
    masks = [None, torch.randn(1, 1, 1, sk, generator=g), torch.randn(b, 1, sq, sk, generator=g),
             torch.randn(sk, generator=g), torch.randn(b, h, sq, 1, generator=g)]  # fmt: skip
    for mask in masks:
        got = ATTENTION(q, k, v, mask, 0.3, heads_last)
        want = reference(q, k, v, mask, 0.3)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        if heads_last:  # [B, Sq, H, Dv] in memory: the heads merged back without a copy
            assert got.transpose(1, 2).is_contiguous()


def test_masks_of_minus_infinity_and_the_lowest_float(path) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5)
    mask[..., 3:] = -math.inf  # padding keys
    mask[0, 0, 1] = torch.finfo(torch.float32).min  # a row of the lowest float: uniform
    mask[1, 0, 2] = -math.inf  # a row with no key at all: NaN, as softmax makes it
    got = ATTENTION(q, k, v, mask, 0.5, False)
    want = reference(q, k, v, mask, 0.5)
    assert torch.isnan(want[1, :, 2]).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, equal_nan=True)
    assert not torch.isnan(got[0]).any() and not torch.isnan(got[1, :, 3]).any()


def test_a_crafted_argument_is_refused() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NativeArgumentError, match=r"quantree\.attention: q is torch\.int8"):
        ATTENTION(q.to(torch.int8), q, q, None, 1.0, False)
    with pytest.raises(NativeArgumentError, match="do not share batch and heads"):
        ATTENTION(q, torch.zeros(1, 3, 4, 8), q, None, 1.0, False)
    with pytest.raises(NativeArgumentError, match="k's features"):
        ATTENTION(q, torch.zeros(1, 2, 4, 7), q, None, 1.0, False)
    with pytest.raises(NativeArgumentError, match="v's rows"):
        ATTENTION(q, q, torch.zeros(1, 2, 5, 8), None, 1.0, False)
    with pytest.raises(NativeArgumentError, match="does not broadcast"):
        ATTENTION(q, q, q, torch.zeros(1, 2, 4, 5), 1.0, False)
    with pytest.raises(NativeArgumentError, match="rows, features"):
        ATTENTION(q[0], q[0], q[0], None, 1.0, False)


class SelfAttention(nn.Module):
    """BERT's eager attention, op for op: q/k/v projections, heads split, scores scaled
    (``*`` or ``/``), an additive mask, softmax, weighted sum, heads merged, projection."""

    def __init__(self, width: int = 32, heads: int = 4, divide: bool = False) -> None:
        super().__init__()
        self.heads, self.divide = heads, divide
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        d = q.shape[-1]
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(d) if self.divide else scores * d**-0.5
        p = torch.softmax(scores + mask, dim=-1)
        out = torch.matmul(p, v).transpose(1, 2).contiguous()
        return self.o(out.reshape(x.shape[0], x.shape[1], -1)) + x


def _data(batch: int, seq: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(6):
        mask = torch.zeros(batch, 1, 1, seq)
        mask[..., seq - 3 :] = torch.finfo(torch.float32).min  # padded tokens, as BERT masks
        out.append((torch.randn(batch, seq, 32, generator=g), mask))
    return out


@pytest.mark.parametrize("divide", [False, True], ids=["mul", "div"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_block_becomes_one_call_and_follows_the_reference(divide, batch) -> None:
    data = _data(batch)
    model = SelfAttention(divide=divide).eval()
    ref = qt.quantize(model, data[0], data, backend="reference", progress=False)
    fused = qt.lower(ref, CPU)
    unfused = qt.lower(ref, cpu_backend(attention=False))
    assert len(calls(fused, ATTENTION)) == 1
    left = [aten.matmul.default, aten.softmax.int, aten.mul.Tensor, aten.div.Tensor]
    assert not any(calls(fused, op) for op in left)
    assert not calls(unfused, ATTENTION) and calls(unfused, aten.softmax.int)
    statuses = [s.status for s in op_statuses(fused) if s.op == "quantree.attention.default"]
    assert statuses == [NATIVE_FLOAT]  # float, as the reference says, and reported so
    others = _data(5)[:1] if batch > 1 else []  # the batch captured dynamic: another size
    for args in data + others:
        want, got = unfused(*args), fused(*args)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got, ref(*args), atol=ATOL, rtol=RTOL)


def test_quantized_scores_are_not_this_form() -> None:
    """A quantizer that puts the scores' matmul on int8 grids leaves q/dq between the ops:
    the block keeps its int8 matmul, no float attention call claims it."""
    act = qt.QuantSpec(qt.QDtype.INT8)
    both = qt.Annotation(outputs=act, inputs={(0,): act, (1,): act})
    rule = qt.Rule((aten.matmul.default,), lambda n: both)
    quantizer = qt.Int8Quantizer() + qt.Quantizer((rule,))
    data = _data(1)
    low = qt.quantize(SelfAttention().eval(), data[0], data, quantizer=quantizer, backend=CPU,
                      progress=False)  # fmt: skip
    assert not calls(low, ATTENTION) and calls(low, torch.ops.quantree.matmul.default)


def test_saved_and_loaded_it_computes_the_same(tmp_path) -> None:
    data = _data(2)
    low = qt.quantize(SelfAttention().eval(), data[0], data, backend=CPU, progress=False)
    assert calls(low, ATTENTION)
    save(low, tmp_path / "attention.pt2", data[0])
    loaded = load(tmp_path / "attention.pt2")
    torch.testing.assert_close(loaded(*data[1]), low(*data[1]), atol=ATOL, rtol=RTOL)


class EncoderLayer(nn.Module):
    """A BERT layer, op for op: the block above, then residual add and layer norm, the
    feed-forward (linear, gelu, linear), residual add and layer norm."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.attention = SelfAttention(width, heads, divide=True)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.n1(self.attention(x, mask))
        return self.n2(self.down(nn.functional.gelu(self.up(h))) + h)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


def _codes(low: torch.fx.GraphModule) -> list[list[list[int]]]:
    return [getattr(low, str(n.args[2].target)).tolist() for n in calls(low, PROGRAM)]


PROGRAM = torch.ops.quantree.program.default
ATTENTION_CODE, COPY_CODE = 15, 5


def test_an_encoder_runs_as_one_program_with_its_attention() -> None:
    """Attention whose q, k, v are heads of [B, S, H D] values and whose output merges the
    heads back is an instruction of the program around it: the two layers (q/k/v linears,
    attention, projection, adds, layer norms, feed-forward) are one call, no attention call
    and no copy of a head left, and it follows the same graph lowered with the attention as
    calls between programs within float rounding."""
    data = _data(1)
    torch.manual_seed(0)
    ref = qt.quantize(Encoder().eval(), data[0], data, backend="reference", progress=False)
    low = qt.lower(ref, CPU)
    form = regions.program_form
    regions.program_form = lambda *a, **k: None  # type: ignore[assignment]
    try:
        calls_between = qt.lower(ref, CPU)
    finally:
        regions.program_form = form  # type: ignore[assignment]
    assert not calls(low, ATTENTION) and len(calls(low, PROGRAM)) == 1
    assert len(calls(calls_between, ATTENTION)) == 2
    code = _codes(low)[0]
    assert [c[0] for c in code].count(ATTENTION_CODE) == 2
    assert not [c for c in code if c[0] == COPY_CODE]
    statuses = [s for s in op_statuses(low) if "attention" in s.op]
    assert not statuses or all(s.status == NATIVE_FLOAT for s in statuses)
    for args in data:
        want, got = calls_between(*args), low(*args)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        assert sqnr(ref(*args), got) > 30.0


def test_saved_and_loaded_the_program_computes_the_same(tmp_path) -> None:
    data = _data(1)
    low = qt.quantize(Encoder().eval(), data[0], data, backend=CPU, progress=False)
    assert any(c[0] == ATTENTION_CODE for code in _codes(low) for c in code)
    save(low, tmp_path / "encoder.pt2", data[0])
    loaded = load(tmp_path / "encoder.pt2")
    torch.testing.assert_close(loaded(*data[1]), low(*data[1]), atol=0.0, rtol=0.0)


def _attention_tables(**change: int) -> tuple[list, list[list[int]]]:
    """Slots q, k, v [12, 32], the result [12, 32] (owners) and a [1, 12] mask; one
    ATTENTION row over them: 2 heads of 16, 12 queries and keys, the mask one row for all."""
    slots = [program_checks.Slot(0, i, 0, 0, 32, 32, 12, 0) for i in range(4)]
    slots.append(program_checks.Slot(0, 4, 0, 0, 12, 12, 1, 0))
    row = dict(op=15, dst=3, q=0, k=1, v=2, mask=4, heads=2, sq=12, sk=12, mode=1, d=16, dv=16)
    row.update(change)
    return slots, [list(row.values())]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({}, None),
        ({"heads": 4}, "narrower than H D"),
        ({"sk": 13}, "Sk per batch"),
        ({"sq": 5}, "whole number of batches"),
        ({"dst": 0}, "not an owner"),
        ({"mode": 3}, "mask row flag"),
        ({"mode": 0, "sq": 6}, "Sk per batch"),
        ({"sk": 12, "mask": 4, "mode": 2}, "fewer rows than its flag"),
        ({"d": 0}, "out of range"),
    ],
    ids=str,
)
def test_crafted_attention_instructions_are_refused(change, said) -> None:
    slots, code = _attention_tables(**change)
    fcode = [[0.25] + [0.0] * 7]
    if said is None:
        program_checks.instructions("program", code, fcode, slots, 0, True)
        with pytest.raises(NativeArgumentError, match="region programs only"):
            program_checks.instructions("cell_loop", code, fcode, slots, 0, False)
        return
    with pytest.raises(NativeArgumentError, match=said):
        program_checks.instructions("program", code, fcode, slots, 0, True)
