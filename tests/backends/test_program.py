"""Runs of small lowered ops become one native region program (``quantree.program``).

A recurrence stepped in Python with modules (a layer-normed LSTM, as torchaudio's RNN-T
predictor writes it) leaves a dozen small ops per step. The program runs them in one call:
int8 ops with their kernels' bits (a region of int8 ops only equals the unfused graph
exactly), float ones in float32 (layer norm and the vector sigmoid/tanh differ from ATen by
rounding: SQNR against the reference graph, 35 dB over 6 recurrent steps).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu import backend as cpu_backend
from quantree.backends.cpu.native.loader import cpu_isa
from quantree.backends.cpu.passes import regions
from quantree.core.graphs import fetch_attr
from quantree.tools.inspection import NATIVE_FLOAT, op_statuses
from quantree.tools.metrics import sqnr

from support import calls

PROGRAM = torch.ops.quantree.program.default
aten = torch.ops.aten


class NormedLSTM(nn.Module):
    """An LSTM with layer-normed gates and cell, stepped in Python (no aten.lstm)."""

    def __init__(self, inputs: int = 12, hidden: int = 16, gates: bool = True) -> None:
        super().__init__()
        self.x2g = nn.Linear(inputs, 4 * hidden)
        self.p2g = nn.Linear(hidden, 4 * hidden, bias=False)
        self.g_norm, self.c_norm = nn.LayerNorm(4 * hidden), nn.LayerNorm(hidden)
        self.hidden, self.gates = hidden, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, B, I]
        h = x.new_zeros(x.shape[1], self.hidden)
        c = x.new_zeros(x.shape[1], self.hidden)
        outs = []
        for g in self.x2g(x).unbind(0):
            g = self.g_norm(g + self.p2g(h))
            i, f, z, o = g.chunk(4, 1)
            if self.gates:
                i, f, z, o = i.sigmoid(), f.sigmoid(), z.tanh(), o.sigmoid()
            c = self.c_norm(f * c + i * z)
            h = o * (c.tanh() if self.gates else c)
            outs.append(h)
        return torch.stack(outs, 0)


def _data(n: int = 6, seed: int = 0, steps: int = 6, batch: int = 2) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(steps, batch, 12, generator=g),) for _ in range(n)]


def _lowered(model: nn.Module, fuse: bool = True, dynamic_batch: bool = True, batch: int = 2):
    data = _data(batch=batch)
    ref = qt.quantize(
        model.eval(),
        data[0],
        data,
        progress=False,
        dynamic_batch=dynamic_batch,
        backend="reference",
    )
    if not fuse:
        original = cpu_backend.fuse_regions
        cpu_backend.fuse_regions = lambda gm: 0  # type: ignore[assignment]
        try:
            return ref, qt.lower(ref, CPU)
        finally:
            cpu_backend.fuse_regions = original
    return ref, qt.lower(ref, CPU)


def test_normed_lstm_runs_as_one_program() -> None:
    torch.manual_seed(0)
    ref, low = _lowered(NormedLSTM())
    assert len(calls(low, PROGRAM)) == 1
    left = {n.target for n in low.graph.nodes if n.op == "call_function"}
    for op in (aten.sigmoid.default, aten.tanh.default, aten.layer_norm.default, aten.mul.Tensor):
        assert op not in left
    with torch.no_grad():
        for (x,) in _data(3, seed=1):  # never calibrated on
            assert sqnr(ref(x), low(x)) > 35.0


def test_int8_region_equals_the_unfused_graph_exactly() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(9))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Chain()
    _, fused = _lowered(model, dynamic_batch=False)
    _, plain = _lowered(model, fuse=False, dynamic_batch=False)
    assert len(calls(fused, PROGRAM)) == 1 and not calls(plain, PROGRAM)
    with torch.no_grad():
        for (x,) in _data(3, seed=2):
            assert torch.equal(fused(x), plain(x))
    _, dynamic = _lowered(model)  # a dimension that varies: one program for every size
    _, unfused = _lowered(model, fuse=False)
    assert len(calls(dynamic, PROGRAM)) == 1
    with torch.no_grad():
        for steps in (6, 3, 1):
            (x,) = _data(1, seed=steps, steps=steps)[0]
            assert torch.equal(dynamic(x), unfused(x))


class Rowwise(nn.Module):
    """Row by row ops only (column slices and cats, a layer norm, gelu, a residual add), so
    the first dimension may vary."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(32, 12)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        z = self.norm(torch.cat([y[..., :8], torch.nn.functional.gelu(y)[..., 8:]], -1))
        return self.c(torch.cat([self.b(z) + y, y], -1))


def test_dynamic_program_after_save_load_runs_other_sizes(tmp_path) -> None:
    """A saved program with a symbolic size is data (its sizes ``a + b * s`` in integer
    lists), and the loaded model runs sizes it was not saved with, bit for bit."""
    torch.manual_seed(0)
    model = Rowwise()
    _, low = _lowered(model)
    _, unfused = _lowered(model, fuse=False)
    (node,) = calls(low, PROGRAM)
    assert node.args[-1], "the program reads its size from an input"
    (x,) = _data(1, seed=7)[0]
    save(low, tmp_path / "rowwise.pt2", (x,))
    loaded = load(tmp_path / "rowwise.pt2")
    with torch.no_grad():
        for steps in (6, 4, 9):
            (x,) = _data(1, seed=8, steps=steps)[0]
            assert torch.equal(loaded(x), low(x))
            assert sqnr(unfused(x), low(x)) > 60.0


@pytest.mark.parametrize("gates", [True, False], ids=["sigmoid-tanh", "norms-only"])
def test_program_bits_on_every_path(select, gates: bool) -> None:
    """Layer norm, linears and add/mul give the same bits on every path; sigmoid/tanh those
    of the recurrent kernels, equal on the vector paths (portable calls libm)."""
    torch.manual_seed(0)
    _, low = _lowered(NormedLSTM(gates=gates))
    (x,) = _data(1, seed=3)[0]
    paths = ["portable", "avx2", "avxvnni", "avx512vnni"]
    got = {}
    with torch.no_grad():
        for name in paths:
            if select(name):
                got[name] = low(x)
    vector = [n for n in got if n != "portable"]
    for name in vector[1:]:
        assert torch.equal(got[name], got[vector[0]]), name
    if not gates and vector:
        assert torch.equal(got["portable"], got[vector[0]])


def test_float_inside_is_reported_by_lowering_and_inspect() -> None:
    torch.manual_seed(0)
    data = _data()
    ref = qt.quantize(NormedLSTM().eval(), data[0], data, progress=False, backend="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        low = qt.lower(ref, CPU)
    said = " ".join(str(w.message) for w in caught)
    assert "aten.layer_norm.default x12" in said and "in native program" in said
    (status,) = [s for s in op_statuses(low) if s.op == "quantree.program.default"]
    assert status.status == NATIVE_FLOAT
    assert "layer_norm 12" in status.detail and "sigmoid 18" in status.detail


def test_an_op_a_program_runs_is_named_by_one_warning_only() -> None:
    """The simulated-op warning looks at the graph after fusion: ops now inside a program
    are the float-op warning's ("in native program"), not called simulated as well."""
    torch.manual_seed(0)
    data = _data()
    ref = qt.quantize(NormedLSTM().eval(), data[0], data, progress=False, backend="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qt.lower(ref, CPU)
    said = [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    assert any("in native program" in text for text in said)
    assert not any("between quantize/dequantize" in text for text in said), said


def test_save_load_and_other_shapes(tmp_path) -> None:
    torch.manual_seed(0)
    _, low = _lowered(NormedLSTM())
    (x,) = _data(1, seed=4)[0]
    save(low, tmp_path / "normed.pt2", (x,))
    loaded = load(tmp_path / "normed.pt2")
    with torch.no_grad():
        assert torch.equal(loaded(x), low(x))
        (node,) = calls(low, PROGRAM)
        args = list(node.args)
        inputs = [torch.randn(6, 3, 12)]  # the region's input is x2g's output, [6, 2, 64]
        tensors = [fetch_attr(low, str(a.target)) for a in args[2:7]]
        consts = [fetch_attr(low, str(c.target)) for c in args[1]]
        with pytest.raises(ValueError, match="compiled for inputs of shapes"):
            torch.ops.quantree.program(inputs, consts, *tensors, *args[7:])


class Glue(nn.Module):
    """Emformer-like glue between int8 linears: row slices, cats along rows and columns, a
    permute of a size-1 dimension, contiguous, zero rows, a float tanh, layer norm and gelu."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(32, 12)
        self.norm = nn.LayerNorm(32)  # the recipe then leaves the glue float

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, 1, 12]
        y = self.a(x).permute(1, 0, 2).permute(1, 0, 2).contiguous()
        head, tail, none = y[:2], y[2:].tanh(), y[y.shape[0] :]
        z = self.b(torch.cat([tail, none, head], 0))
        z = torch.cat([z, y], -1)
        return self.c(torch.nn.functional.gelu(self.norm(z))[1:])


class Moves(nn.Module):
    """Int8 linears joined by data movement only: row slices and a cat along columns."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(32, 12)
        self.d, self.e = nn.Linear(12, 12), nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the slices are int8 views (no quantize/dequantize of their own since int8 slices are
        # lowered as data movement): two more linears keep the program at MIN_OPS
        y = self.a(x)
        return self.e(self.d(self.c(torch.cat([self.b(y[1:]), y[:-1]], -1))))


def test_slices_cats_and_views_in_a_program() -> None:
    """Data movement copies bits: int8 linears joined by slices and cats give the unfused
    graph's bits; with the gelu and tanh (float32, rounding only) 60 dB against it."""
    torch.manual_seed(0)
    for model, exact in ((Moves(), True), (Glue(), False)):
        _, fused = _lowered(model, dynamic_batch=False, batch=1)
        _, plain = _lowered(model, fuse=False, dynamic_batch=False, batch=1)
        assert len(calls(fused, PROGRAM)) == 1 and not calls(plain, PROGRAM)
        left = {n.target for n in fused.graph.nodes if n.op == "call_function"}
        assert not left & {aten.cat.default, aten.slice.Tensor, aten.gelu.default}
        with torch.no_grad():
            for (x,) in _data(3, seed=5, batch=1):
                if exact:
                    assert torch.equal(fused(x), plain(x))
                else:
                    assert sqnr(plain(x), fused(x)) > 60.0
    (status,) = [s for s in op_statuses(fused) if s.op == "quantree.program.default"]
    assert "gelu 1" in status.detail and "tanh 1" in status.detail


def test_large_layer_norms_and_gelus_stay_with_aten_but_on_vector_row_paths() -> None:
    """A program's layer norm and gelu are scalar loops but on the AVX-512 and AVX2 paths
    (vector rows, ``test_program_vector_rows.py``): over a transformer's activations ATen's
    vectorized kernels are faster, so on other paths those ops are left out of programs."""
    torch.manual_seed(0)
    _, small = _lowered(Rowwise())
    _, large = _lowered(Rowwise(), batch=1024)  # 1024 x 16 values an op at batch 1
    small_ops = {n.target for n in small.graph.nodes}
    large_ops = {n.target for n in large.graph.nodes}
    assert not {aten.layer_norm.default, aten.gelu.default} & small_ops
    if cpu_isa() in regions.VECTOR_ROW_PATHS:
        assert not {aten.layer_norm.default, aten.gelu.default} & large_ops
    else:
        assert {aten.layer_norm.default, aten.gelu.default} <= large_ops


def _program_binding(low: nn.Module):
    (node,) = calls(low, PROGRAM)
    return node, node.target.binding


def test_a_program_node_plans_its_call_and_checks_again_when_a_table_changes() -> None:
    """The second call of a shape runs the plan (``native/bound_programs.py``): the same
    values as the op's full path; a table changed in place or a constant replaced sends
    the call through the full checks again, which refuse a bad table."""
    import copy

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(9))
            self.norm = nn.LayerNorm(12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    torch.manual_seed(0)
    _, low = _lowered(Chain())  # one dynamic program for every length
    node, binding = _program_binding(low)
    fresh = copy.deepcopy(low)  # plans are not copied: its calls start on the full path
    assert not _program_binding(fresh)[1].plans
    with torch.no_grad():
        for steps in (6, 3, 6):
            (x,) = _data(1, seed=steps, steps=steps)[0]
            first, planned = low(x), low(x)
            assert torch.equal(first, planned)
            assert torch.equal(planned, copy.deepcopy(low)(x))
    assert len(binding.plans) == 2  # 6 and 3 steps: the program's size symbol
    code = fetch_attr(low, str(node.args[2].target))
    saved = code.clone()
    with torch.no_grad():
        code[0, 0] = 99  # an opcode no program has: the version moves, the plan is not taken
        with pytest.raises(qt.QuantreeError, match="opcode"):
            low(x)
        code.copy_(saved)
        assert torch.equal(low(x), planned)
        weight = node.args[1][0]
        held = fetch_attr(low, str(weight.target))
        setattr(low, str(weight.target), held.clone())  # another tensor: a new plan
        assert torch.equal(low(x), planned)


class ChunkwiseParallel(nn.Module):
    """The float arithmetic of xLSTM's chunkwise-parallel part (stabilised exps, a scaled
    ``q k^T``, a division by a floored normaliser), as a lowered graph leaves it between
    its int8 ops: no loop, no q/dq."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor):
        m = g.amax(-1, keepdim=True).clamp_min(-1.0)  # one stabiliser per row
        d = torch.exp(g - m)
        s = (q @ k.transpose(-2, -1)) * 0.25 * d
        h = s @ v
        n = s.sum(-1, keepdim=True)
        return h / (torch.maximum(n.abs(), torch.exp(-m)) + 1e-6)


@pytest.mark.parametrize(("chunks", "fused"), [(4, True), (64, True), (320, False)])
def test_small_float_math_outside_a_loop_runs_in_a_program(chunks: int, fused: bool) -> None:
    """``region_math``'s ops join programs in any graph where they are small
    (``region_strided.MAX_ELEMENTS``): xLSTM's ``[1, 2, 4, 16, 16]`` at 64 tokens, and
    ``[1, 2, 64, 16, 16]`` at 1024; at 5120 tokens (``[1, 2, 320, 16, 16]``, 163840 values)
    they stay ATen's. Float32 arithmetic as ATen's up to summation order (rtol 1e-5)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, chunks, 16, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 2, chunks, 16, 32, generator=g)
    gate = torch.randn(1, 2, chunks, 16, 16, generator=g)
    ex = (q, k, v, gate)
    gm = torch.export.export(ChunkwiseParallel(), ex).module()
    want = gm(*ex)
    assert regions.fuse_regions(gm) == int(fused)
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert ("aten.exp.default" in left) is not fused
    assert ("aten.matmul.default" in left) is not fused
    torch.testing.assert_close(gm(*ex), want, rtol=1e-5, atol=1e-5)
    plain = torch.export.export(ChunkwiseParallel(), ex).module()
    assert regions.fuse_regions(plain, small_math=False) == 0  # before: none of it


class HeadNorm(nn.Module):
    """xLSTM's multi-head layer norm's statistics: mean and (biased, then unbiased) variance
    over each head's last dimension, then ``(x - mean) rsqrt(var + eps)``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.transpose(1, 2)
        mean = h.mean(-1, keepdim=True)
        var = h.var(-1, unbiased=False, keepdim=True)
        normed = (h - mean) * torch.rsqrt(var + 1e-6) * 2.0 + 0.5
        return normed, h.var(-1) + 1.0


def test_means_and_variances_over_the_last_dimension_run_in_a_program() -> None:
    """``mean`` / ``var`` over the last dimension as row sums in double (``ROW_SUM``), a
    scale and a column subtraction: ATen's values up to rounding (rtol 1e-5)."""
    x = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1
    gm = torch.export.export(HeadNorm(), (x,)).module()
    want = gm(x)
    assert regions.fuse_regions(gm, min_ops=1) == 1
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not {"aten.mean.dim", "aten.var.dim", "aten.var.correction"} & left
    for got, ref in zip(gm(x), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
