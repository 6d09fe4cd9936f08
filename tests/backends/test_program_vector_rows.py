"""Large layer norms and gelus in region programs: the AVX-512 and AVX2 paths' vector rows.

On the AVX-512 and AVX2 (AVX-VNNI) paths the region pass takes layer norms and gelus of any size
(``regions.float_limit``) and marks those over ``FLOAT_MAX_ELEMENTS`` values for the vector rows of
``csrc/program_avx512.cpp`` / ``csrc/program_avx2.cpp``; smaller ones keep the scalar loops (the
same bits on every path as before). Float ops in a program follow ATen up to float rounding: the
region tests' bound is 60 dB SQNR against the unfused graph; here also every element within
``1e-5 + 1e-5 |want|`` of ATen's, widths off the 16- and 8-lane vectors (tails) included, on
every vector path this CPU runs and the portable loops the same program falls back to elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import quantree as qt
import quantree.backends.cpu.passes.regions as regions
from quantree.backends import CPU, cpu_backend
from quantree.backends.cpu.native.loader import cpu_isa
from quantree.tools.metrics import sqnr

from support import calls

PROGRAM = torch.ops.quantree.program.default
ATTENTION = torch.ops.quantree.attention.default
ATTENTION_CODE = 15
aten = torch.ops.aten
LAYER_NORM, FLOAT_UNARY, COPY, LINEAR, LINEAR16 = 9, 8, 5, 2, 10
VECTOR = cpu_isa() in regions.VECTOR_ROW_PATHS


class Floats(nn.Module):
    """Residual adds, layer norms and both gelus, float throughout (the recipe quantizes
    none of them), so the program's values meet ATen's directly."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        for n in (self.n1, self.n2, self.n3):
            nn.init.normal_(n.weight, std=2.0)
            nn.init.normal_(n.bias)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.n1(x + r)
        u = self.n2(nn.functional.gelu(y) + y)
        return self.n3(nn.functional.gelu(u, approximate="tanh") + x)


def _floats(width: int, rows: int = 0) -> tuple[torch.fx.GraphModule, nn.Module, list]:
    rows = rows or regions.FLOAT_MAX_ELEMENTS // width + 5  # default: over the loops' limit
    g = torch.Generator().manual_seed(width)
    data = [
        (torch.randn(1, rows, width, generator=g) * 3, torch.randn(1, rows, width, generator=g))
        for _ in range(3)
    ]
    model = Floats(width).eval()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference",
                      dynamic_batch=False)  # fmt: skip
    return qt.lower(ref, CPU), model, data


@pytest.mark.skipif(not VECTOR, reason="only the vector rows' paths take large layer norms")
@pytest.mark.parametrize("width", [1, 7, 15, 17, 37, 131, 773])
def test_vector_rows_follow_aten_at_odd_widths(select, width: int) -> None:
    low, model, data = _floats(width)
    assert len(calls(low, PROGRAM)) == 1
    left = {n.target for n in low.graph.nodes if n.op == "call_function"}
    assert not left & {aten.layer_norm.default, aten.gelu.default, aten.add.Tensor}
    paths = [n for n in ("avx512vnni", "avxvnni", "avx2", "portable") if select(n)]
    assert cpu_isa() in paths and "portable" in paths  # each vector row kind, then the loops
    for name in paths:
        assert select(name)
        with torch.no_grad():
            for x, r in data[1:]:
                want, got = model(x, r), low(x, r)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                assert sqnr(want, got) > 60.0


def _code(low: torch.fx.GraphModule) -> list[list[int]]:
    (node,) = calls(low, PROGRAM)
    return getattr(low, str(node.args[2].target)).tolist()


def test_only_large_ops_are_marked_for_vector_rows() -> None:
    """A program's small layer norms and gelus keep the scalar loops (unmarked: their bits
    as before, on every path); large ones are taken only where the vector rows are, and
    marked for them."""
    small, _, _ = _floats(64, rows=8)
    large, _, _ = _floats(64)
    code = _code(small)
    assert all(c[5] == 0 for c in code if c[0] == LAYER_NORM)
    assert all(c[4] == 0 for c in code if c[0] == FLOAT_UNARY)
    if not VECTOR:
        assert {aten.layer_norm.default, aten.gelu.default} <= {n.target for n in large.graph.nodes}
        return
    code = _code(large)
    norms = [c for c in code if c[0] == LAYER_NORM]
    gelus = [c for c in code if c[0] == FLOAT_UNARY and c[3] in (3, 4)]
    assert len(norms) == 3 and len(gelus) == 2
    assert all(c[5] == 1 for c in norms) and all(c[4] == 1 for c in gelus)


class Layer(nn.Module):
    """A BERT layer, op for op: attention (q/k/v, heads, scaled scores, mask, softmax),
    output projection, residual add and layer norm, then the feed-forward (linear, gelu,
    linear), residual add and layer norm."""

    def __init__(self, width: int = 64, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        p = torch.softmax(scores + mask, dim=-1)
        a = torch.matmul(p, v).transpose(1, 2).contiguous().reshape(x.shape)
        h = self.n1(self.o(a) + x)
        return self.n2(self.down(nn.functional.gelu(self.up(h))) + h)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_a_bert_layer_after_attention_is_one_program() -> None:
    """Each layer's output projection, residual adds, layer norms, feed-forward and gelu,
    the next layer's q/k/v linear and its attention (an ``ATTENTION`` instruction reading the
    heads as column blocks) run as one program, with no row copies after its last linear."""
    seq = regions.FLOAT_MAX_ELEMENTS // 64 + 8  # 200 x 64 values a layer norm: large
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        mask = torch.zeros(1, 1, 1, seq)
        mask[..., seq - 5 :] = torch.finfo(torch.float32).min
        data.append((torch.randn(1, seq, 64, generator=g), mask))
    torch.manual_seed(0)
    ref = qt.quantize(Encoder().eval(), data[0], data[:3], progress=False, backend="reference")
    low = qt.lower(ref, CPU)
    limit = regions.float_limit
    regions.float_limit = lambda: float(regions.FLOAT_MAX_ELEMENTS)  # type: ignore[assignment]
    try:
        aten_ops = qt.lower(ref, cpu_backend())
    finally:
        regions.float_limit = limit  # type: ignore[assignment]
    codes = [getattr(low, str(node.args[2].target)).tolist() for node in calls(low, PROGRAM)]
    inside = sum(c[0] == ATTENTION_CODE for code in codes for c in code)
    assert len(calls(low, ATTENTION)) + inside == 2
    if not VECTOR:
        assert calls(low, aten.layer_norm.default) and calls(low, aten.gelu.default)
        return
    programs = calls(low, PROGRAM)
    assert len(programs) == 1 and inside == 2  # both layers, their attention an instruction
    for op in (aten.layer_norm.default, aten.gelu.default, aten.add.Tensor):
        assert not calls(low, op), op
        assert calls(aten_ops, op), op  # ATen's below the scalar loops' limit
    for node in programs:
        code = getattr(low, str(node.args[2].target)).tolist()
        last = max(i for i, c in enumerate(code) if c[0] in (LINEAR, LINEAR16))
        assert not [c for c in code[last:] if c[0] == COPY]  # the next q/k/v heads: views
    with torch.no_grad():
        x, mask = data[3]
        want, got = aten_ops(x, mask), low(x, mask)
        assert sqnr(want, got) > 60.0
