"""A folded loop's lowered step run as one native program for every step
(``backends/cpu/cells/step_program.py``, ``quantree.program_loop``)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends.cpu.cells import step_program
from quantree.backends.cpu.cells.program_loop import checked_loop, program_loop
from quantree.backends.cpu.cells.step_program import NativeProgramLoop
from quantree.backends.cpu.passes.regions import fuse_regions
from quantree.backends.fastest import reference_of
from quantree.recurrent.unrolled.step_loop import StepLoop

from support import selective_scan


class LightGRULike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(6, 16, bias=False)
        self.u = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wx = self.w(x)
        h = torch.zeros(x.shape[0], 8)
        ys = []
        for t in range(x.shape[1]):
            a, z = (wx[:, t] + self.u(h)).chunk(2, dim=-1)
            z = torch.sigmoid(z)
            h = z * h + (1 - z) * torch.relu(a)
            ys.append(h)
        return torch.stack(ys, 1)


class MaskedLightGRU(LightGRULike):
    """SpeechBrain's ``LiGRU`` step: the candidate times a dropout mask, in eval mode a
    one-element tensor of ones made before the loop (an int8 binary with a broadcast [1]
    operand the step reads as a loop invariant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wx = self.w(x)
        mask = torch.ones(1)
        h = torch.zeros(x.shape[0], 8)
        ys = []
        for t in range(x.shape[1]):
            a, z = (wx[:, t] + self.u(h)).chunk(2, dim=-1)
            z = torch.sigmoid(z)
            h = z * h + (1 - z) * (torch.relu(a) * mask)
            ys.append(h)
        return torch.stack(ys, 1)


class ScanLike(nn.Module):
    """A selective scan's sequential step: state [B, D, N] decayed by a per-step factor,
    read out by a per-step [B, N] vector (Mamba-1's slow path)."""

    def __init__(self) -> None:
        super().__init__()
        self.a_log = nn.Parameter(torch.randn(4, 3))
        self.proj = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 5]
        dt = nn.functional.softplus(self.proj(x))  # [B, T, 4]
        decay = torch.exp(-torch.exp(self.a_log)[None, None] * dt[..., None])  # [B, T, 4, 3]
        drive = dt[..., None] * x[..., :3, None].transpose(-1, -2)  # [B, T, 4, 3]
        state = torch.zeros(x.shape[0], 4, 3)
        ys = []
        for t in range(x.shape[1]):
            state = decay[:, t] * state + drive[:, t]
            ys.append(torch.matmul(state, x[:, t, 2:5, None])[:, :, 0])
        return torch.stack(ys, -1)


class TimeThirdScan(ScanLike):
    """``ScanLike`` with Mamba-1's layout: per-step inputs cut from dimension 2 of
    ``[B, D, T, N]`` (each step's rows evenly spaced: read in place, not copied)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 5]
        dt = nn.functional.softplus(self.proj(x))  # [B, T, 4]
        decay = torch.exp(-torch.exp(self.a_log)[None, None] * dt[..., None]).transpose(1, 2)
        drive = (dt[..., None] * x[..., :3, None].transpose(-1, -2)).transpose(1, 2)
        return selective_scan(decay, drive, x)


class RGLRULike(nn.Module):
    """RecurrentGemma's RG-LRU scan: a gated linear recurrence whose steps write their state
    into their own slice of a preallocated output (``out[:, t] = h``), with the model's
    ``.type(float32)`` casts and ``.to(device)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 8)
        self.inp = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 6]
        a, u = torch.sigmoid(self.gate(x)), self.inp(x)
        h = torch.zeros(x.shape[0], 8)
        out = torch.zeros_like(u)
        for t in range(x.shape[1]):
            h = a[:, t].type(torch.float32) * h.to(a.device) + u[:, t].type(torch.float32)
            out[:, t] = h.type(u.dtype)
        return out


def _lowered(model: nn.Module, x: torch.Tensor, native: bool, monkeypatch) -> nn.Module:
    generator = torch.Generator().manual_seed(1)  # the same calibration for both
    data = [(torch.randn(x.shape, generator=generator),) for _ in range(3)]
    with monkeypatch.context() as m:
        if not native:
            m.setattr(step_program, "fuse_regions", lambda *a, **k: 0)
        # a step left in Python is said; a native one may warn of its calibration or not
        with pytest.warns(qt.QuantreeWarning) if not native else warnings.catch_warnings():
            return qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=True)


@pytest.mark.parametrize(
    "model_type", [LightGRULike, MaskedLightGRU, ScanLike, TimeThirdScan, RGLRULike]
)
def test_a_folded_step_runs_as_one_program_equal_to_its_python_loop_at_any_length(
    model_type, monkeypatch
):
    torch.manual_seed(0)
    model = model_type().eval()
    x = torch.randn(2, 9, 5 if issubclass(model_type, ScanLike) else 6)
    native = _lowered(model, x, True, monkeypatch)
    python = _lowered(model, x, False, monkeypatch)
    assert [type(m) for m in native.modules() if isinstance(m, NativeProgramLoop)] == [
        NativeProgramLoop
    ]
    assert [type(m) for m in python.modules() if isinstance(m, StepLoop)] == [StepLoop]
    for length in (1, 4, 9, 40):  # captured at 9
        y = torch.randn(2, length, x.shape[-1])
        with torch.no_grad():
            assert torch.equal(native(y), python(y))  # the same int8 ops, natively
            if not issubclass(model_type, ScanLike):  # (a toy scan: its recipe's matter)
                assert qt.sqnr(model(y), native(y)) > 20  # dB; int8 steps


def _float_step():
    """A float step with broadcasting, scalars, exp / log / softplus, division, clamps,
    maximum and a batched matmul, exported (its ops as the lowering leaves them)."""

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("a", -torch.rand(4, 3) - 0.5)

        def forward(self, state, u, c):  # [B, 4, 3], [B, 4, 3], [B, 3, 2]
            decay = torch.exp(torch.clamp(self.a * 0.5, -4.0, 4.0))
            gate = nn.functional.softplus(u) / (1 + torch.abs(u))
            new = torch.maximum(decay * state + gate, torch.log(torch.sigmoid(u))) - 0.25
            return new, torch.bmm(new, c), torch.rsqrt(new * new + 1)

    ex = (torch.randn(2, 4, 3), torch.randn(2, 4, 3), torch.randn(2, 3, 2))
    gm = torch.export.export(Step(), ex).module()
    return gm, ex


def test_step_math_in_programs_matches_aten_within_rounding():
    gm, ex = _float_step()
    want = gm(*ex)
    assert fuse_regions(gm, min_ops=1, math=True) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.quantree.program.default) == 1
    assert all("aten" not in str(t) for t in ops)  # every op inside the program
    got = gm(*ex)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # libm vs ATen's exp/log


@pytest.mark.parametrize("k", [3, 8, 21])
def test_a_matrix_times_a_vector_in_a_program_matches_aten_within_rounding(k):
    """A scan's read-out ``state @ c[..., None]`` (N = 1: dot products with partial sums,
    a tail past the multiples of 8 included)."""

    class ReadOut(nn.Module):
        def forward(self, state, c):  # [B, D, K], [B, K]
            return torch.matmul(state * 1.5, c.unsqueeze(-1))

    ex = (torch.randn(2, 5, k), torch.randn(2, k))
    gm = torch.export.export(ReadOut(), ex).module()
    want = gm(*ex)
    assert fuse_regions(gm, min_ops=1, math=True) == 1
    torch.testing.assert_close(gm(*ex), want, rtol=1e-5, atol=1e-5)


def _refuses_operand_flags(gm, call, code, row: int, flags, ex) -> None:
    """The program's checker refuses each of ``flags`` as instruction ``row``'s operand flag."""
    for flag in flags:
        tampered = code.clone()
        tampered[row, 5] = flag
        setattr(gm, str(call.args[2].target), tampered)
        with pytest.raises(qt.QuantreeError, match="operand flag"):
            gm(*ex)


def test_a_column_operand_in_a_program_gives_the_same_bits_as_aten():
    """A selective scan's step once its producers moved in (``recurrent/unrolled/sink.py``):
    outer products ``dt[..., None] * b[:, None]`` and ``x * dt[..., None]``, a column of one
    value per row on either side of add / mul / sub / div / maximum: one program, every op
    inside, each element one float op as ATen's (the same bits)."""

    class Outer(nn.Module):
        def forward(self, dt, b, x):  # [B, D], [B, N], [B, D, N]
            col = dt[..., None]
            outer = col * b[:, None]
            return (
                outer + x, x - col, col - x, x / (col + 2), (col + 3) / (x * x + 1),
                torch.maximum(col, x), torch.minimum(x, col), col * x + outer,
            )  # fmt: skip

    ex = (torch.randn(2, 6), torch.randn(2, 5), torch.randn(2, 6, 5))
    gm = torch.export.export(Outer(), ex).module()
    want = gm(*ex)
    assert fuse_regions(gm, min_ops=1, math=True) == 1
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in ops if "aten" in t]  # the input's unsqueeze too: a view inside
    for a, b in zip(gm(*ex), want, strict=True):
        assert torch.equal(a, b)
    call = next(n for n in gm.graph.nodes if n.target == torch.ops.quantree.program.default)
    code = getattr(gm, str(call.args[2].target))  # type: ignore[union-attr]
    rows = [i for i, c in enumerate(code.tolist()) if c[0] == 7 and c[5] in (1, 2)]
    assert rows  # FLOAT_BINARY with a column operand
    _refuses_operand_flags(gm, call, code, rows[0], (5, -1), ex)


def test_a_one_element_float_operand_in_a_program_gives_the_same_bits_as_aten():
    """SpeechBrain's eval-mode drop mask in a float step: a ``[1]`` operand on either side
    of mul / add / sub, read as one value for every element (``FLOAT_BINARY``'s flags 3
    and 4): one program, the same bits as ATen's broadcasting ops."""

    class OneValue(nn.Module):
        def forward(self, x, m):  # [B, 6], [1]
            return x * m, m - torch.relu(x), x + m

    ex = (torch.randn(3, 6), torch.tensor([0.75]))
    gm = torch.export.export(OneValue(), ex).module()
    want = gm(*ex)
    assert fuse_regions(gm, min_ops=1, math=True) == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and "aten" in str(n.target)]
    for a, b in zip(gm(*ex), want, strict=True):
        assert torch.equal(a, b)
    call = next(n for n in gm.graph.nodes if n.target == torch.ops.quantree.program.default)
    code = getattr(gm, str(call.args[2].target))  # type: ignore[union-attr]
    rows = [i for i, c in enumerate(code.tolist()) if c[0] == 7 and c[5] in (3, 4)]
    assert len(rows) == 3
    _refuses_operand_flags(gm, call, code, rows[0], (5, -1), ex)


class Int8Outer(nn.Module):
    """int8 binaries of a selective scan's step once its producers moved in: a column (one
    value per row) on either side of mul / add / sub, the other operand whole or broadcast
    along rows. ``expand``: the same values with every operand made whole first."""

    def __init__(self, expand: bool = False) -> None:
        super().__init__()
        self.expand = expand

    def forward(self, dt, b, x, a):  # [B, D], [B, N], [B, D, N], [1, D, N]
        q = torch.ops.quantree
        col, row = dt[..., None], b[:, None]
        if self.expand:
            col, row, a = (v.expand(x.shape).contiguous() for v in (col, row, a))
        qc, qb, qx = q.quantize(col, 0.02, 3), q.quantize(row, 0.03, -5), q.quantize(x, 0.025, 1)
        qa = q.quantize(a, 0.015, 0)
        outs = [
            q.binary("mul", qc, qb, 0.02, 3, 0.03, -5, 0.004, 2),
            q.binary("add", qx, qc, 0.025, 1, 0.02, 3, 0.03, -1),
            q.binary("sub", qc, qx, 0.02, 3, 0.025, 1, 0.03, 4),
            q.binary("sub", qx, qc, 0.025, 1, 0.02, 3, 0.03, -4),
            q.binary("mul", qa, qc, 0.015, 0, 0.02, 3, 0.002, 0),
        ]
        return tuple(q.dequantize(o, s, z) for o, (s, z) in zip(outs, GRIDS, strict=True))


GRIDS = [(0.004, 2), (0.03, -1), (0.03, 4), (0.03, -4), (0.002, 0)]


def test_an_int8_binary_with_a_column_operand_gives_the_bits_of_the_broadcasting_op():
    """``BINARY``'s column flag (2: b, 3: a): the same bits as the op run on its own (the
    lowering's kernel, broadcasting) and as the program given whole operands (flag 0); within
    one output step of the reference's dequantize-op-quantize."""
    torch.manual_seed(0)
    ex = (torch.randn(2, 6) * 2, torch.randn(2, 5) * 2, torch.randn(2, 6, 5) * 2)
    ex += (torch.randn(1, 6, 5),)
    gm = torch.export.export(Int8Outer(), ex).module()
    whole = torch.export.export(Int8Outer(expand=True), ex).module()
    alone = gm(*ex)
    assert fuse_regions(gm, min_ops=1) == 1 and fuse_regions(whole, min_ops=1) == 1
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "quantree.binary.default" not in ops and "quantree.program.default" in ops
    call = next(n for n in gm.graph.nodes if n.target == torch.ops.quantree.program.default)
    code = getattr(gm, str(call.args[2].target))  # type: ignore[union-attr]
    binaries = [c for c in code.tolist() if c[0] == 3]
    assert sorted(c[5] for c in binaries) == [2, 2, 2, 3, 3]  # a column: b, b, b, a, a
    got = gm(*ex)
    col = ex[0][..., None]

    def fq(v, s, z):
        return (torch.clamp(torch.round(v / s) + z, -128, 127) - z) * s

    c, b, x = fq(col, 0.02, 3), fq(ex[1][:, None], 0.03, -5), fq(ex[2], 0.025, 1)
    a = fq(ex[3], 0.015, 0)
    reference = [c * b, x + c, c - x, x - c, a * c]
    for g, lone, w, r, (s, z) in zip(got, alone, whole(*ex), reference, GRIDS, strict=True):
        assert torch.equal(g, lone) and torch.equal(g, w)
        assert (g - fq(r, s, z)).abs().max() <= s * 1.0001  # rounding v * (1 / s) vs v / s
    rows = [i for i, c in enumerate(code.tolist()) if c[0] == 3 and c[5] == 3]
    _refuses_operand_flags(gm, call, code, rows[0], (4, -1), ex)
    tampered = code.clone()  # a column slot that is not int8: refused, not read as bytes
    tampered[rows[0], 2] = next(c[2] for c in code.tolist() if c[0] == 0)  # a float slot
    setattr(gm, str(call.args[2].target), tampered)  # type: ignore[union-attr]
    with pytest.raises(qt.QuantreeError, match="column operand"):
        gm(*ex)


def test_whole_model_programs_take_step_math_only_small_and_unless_told_not_to(monkeypatch):
    """A whole model's programs (no ``math``) take small math ops (Mamba-2's SSD, xLSTM's
    chunkwise part), leave those over ``region_strided.MAX_ELEMENTS`` values to ATen, and
    take none with ``small_math=False``."""
    from quantree.backends.cpu.passes.instructions import region_strided

    exp = torch.ops.aten.exp.default
    gm, ex = _float_step()
    want = gm(*ex)
    fuse_regions(gm, min_ops=1)
    assert not any(n.target == exp for n in gm.graph.nodes)
    for got, ref in zip(gm(*ex), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    gm, _ = _float_step()
    fuse_regions(gm, min_ops=1, small_math=False)
    assert any(n.target == exp for n in gm.graph.nodes)
    monkeypatch.setattr(region_strided, "MAX_ELEMENTS", 8)  # below the step's [2, 4, 3]
    gm, _ = _float_step()
    fuse_regions(gm, min_ops=1)
    assert any(n.target == exp for n in gm.graph.nodes)


@functools.cache
def _light_gru_lowered() -> tuple[nn.Module, torch.Tensor]:
    """``LightGRULike`` lowered natively once per file (seed 0, captured at 9 steps): the
    tests of its program's tables, file and plans each take a fresh deep copy of it (they
    tamper with its tables and read its plans), not a lowering of their own."""
    torch.manual_seed(0)
    model = LightGRULike().eval()
    x = torch.randn(2, 9, 6)
    with pytest.MonkeyPatch.context() as monkeypatch:
        low = _lowered(model, x, True, monkeypatch)
    assert [m for m in low.modules() if isinstance(m, NativeProgramLoop)]
    return low, x


def _light_gru() -> tuple[nn.Module, torch.Tensor]:
    low, x = _light_gru_lowered()
    return copy.deepcopy(low), x.clone()


def _loop_call(monkeypatch):
    low, x = _light_gru()
    seen = {}

    def spy(*args):
        seen["args"] = args
        return checked_loop(*args)

    monkeypatch.setattr(step_program, "checked_loop", spy)
    with torch.no_grad():
        low(x)
    return list(seen["args"])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (15, "stepped", "per-step inputs"),
        (16, "feed", "feed"),
        (16, "feed a per-step input", "per-step one"),
        (2, "opcode", "opcode"),
        (2, "matmul", "instruction"),
    ],
)
def test_a_tampered_step_program_is_refused_with_a_quantree_error(
    field, value, message, monkeypatch
):
    args = _loop_call(monkeypatch)
    if value == "stepped":
        args[field] = [0] * len(args[field])
    elif value == "feed":
        args[field] = [len(args[0]) + 3] * len(args[field])
    elif value == "feed a per-step input":
        args[field] = [args[15].index(1)] * len(args[field])
    elif value == "opcode":
        code = args[field].clone()
        code[0, 0] = 99
        args[field] = code
    else:  # a batched matmul whose operands are no whole batches
        code = args[field].clone()
        code[0, 0], code[0, 3], code[0, 4] = 13, code[0, 2], 1 << 40
        args[field] = code
    with pytest.raises(qt.QuantreeError, match=message):
        program_loop(*args)


def test_a_saved_step_program_loads_and_runs_the_same(tmp_path):
    from quantree.backends import load, save

    low, x = _light_gru()
    save(low, tmp_path / "loop.pt2", (x,))
    loaded = load(tmp_path / "loop.pt2")
    with torch.no_grad():
        assert torch.equal(loaded(x), low(x))


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ("opcode", r"quantree\.program: instruction 0 .*opcode 99"),
        ("feed", r"quantree\.program_loop: feed \["),
        ("stride", r"quantree\.program: slot \d+ owns its storage with a row stride"),
    ],
)
def test_a_tampered_saved_step_program_is_refused_when_the_file_loads(tamper, message, tmp_path):
    """The folded loop's tables and roles in a file are checked by ``load`` (not at the
    first call), like a region program's: the crafted file never runs."""
    from quantree.backends import load, save
    from quantree.tools.files import BadFile

    low, x = _light_gru()
    (loop,) = [m for m in low.modules() if isinstance(m, NativeProgramLoop)]
    if tamper == "opcode":
        loop.code[0, 0] = 99
    elif tamper == "feed":
        loop.feed = [len(loop.roles) + 3] * len(loop.feed)
    else:
        slots = loop.slots
        owner = next(i for i in range(slots.shape[0]) if slots[i, 1] == i)
        slots[owner, 4] = 2**31 - 1
    save(low, tmp_path / "crafted.pt2", (x,))
    with pytest.raises(BadFile, match=message):
        load(tmp_path / "crafted.pt2")


class NormedScan(nn.Module):
    """``ScanLike`` inside an RMS norm written by hand and a projection: a Mamba-like block,
    whose recipe (``ActivationPoints.AUTO``) quantizes what the linears read only."""

    def __init__(self) -> None:
        super().__init__()
        self.scan = ScanLike()
        self.out = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = self.scan(x)  # [B, 4, T]
        return self.out(torch.cat([y.transpose(1, 2), x], -1))


def test_a_folded_step_takes_the_verdict_of_the_model_it_was_folded_from():
    """Unrolled, a scan's steps are the graph's own ops: a model with RMS norms keeps their
    arithmetic float. Folded, the step graph is annotated on its own but takes the same
    verdict: its ops stay float (no quantize inside the step), and the lowered loop is one
    native program computing what the unrolled lowered model computes, up to float rounding
    (the program's matmul sums in another order than ATen's)."""
    torch.manual_seed(0)
    model = NormedScan().eval()
    x = torch.randn(2, 9, 5)
    data = [(torch.randn(2, 9, 5),) for _ in range(3)]
    q = torch.ops.quantized_decomposed.quantize_per_tensor.default
    prepared = qt.prepare(qt.capture(model, (x,), fold_loops=True), qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    folded_ref = qt.convert(prepared)
    loops = [m for m in folded_ref.modules() if isinstance(m, StepLoop)]
    assert len(loops) == 1
    assert not [n for n in loops[0].body.graph.nodes if n.target == q]
    with pytest.warns(qt.QuantreeWarning):
        folded = qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=True)
    unrolled = qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=False)
    assert len([m for m in folded.modules() if isinstance(m, NativeProgramLoop)]) == 1
    with torch.no_grad():
        assert qt.sqnr(unrolled(x), folded(x)) > 80  # dB: float rounding only
        assert qt.sqnr(model(x), folded(x)) > 30


class CumsumStep(nn.Module):
    """A step with an op no program runs (``cumsum``): folded, it would run op by op."""

    def __init__(self) -> None:
        super().__init__()
        self.u = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 8]
        h = torch.zeros(x.shape[0], 8)
        ys = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.u(h) + x[:, t]).cumsum(-1) * 0.5
            ys.append(h)
        return torch.stack(ys, 1)


@pytest.mark.parametrize("model_type", [NormedScan, MaskedLightGRU, CumsumStep, RGLRULike])
def test_quantize_folds_a_loop_by_default_where_its_step_runs_as_one_program(model_type):
    """``qt.quantize``'s default: the loop folded where the lowered step is one native
    program (then it runs at any length), else the unrolled steps, exactly as
    ``fold_loops=False`` gives them."""
    torch.manual_seed(0)
    model = model_type().eval()
    width = {NormedScan: 5, MaskedLightGRU: 6, CumsumStep: 8, RGLRULike: 6}[model_type]
    x = torch.randn(2, 9, width)
    data = [(torch.randn(2, 9, width),) for _ in range(3)]
    default = qt.quantize(model, (x,), data, backend="cpu", progress=False)
    unrolled = qt.quantize(model, (x,), data, backend="cpu", progress=False, fold_loops=False)
    loops = [m for m in default.modules() if isinstance(m, (StepLoop, NativeProgramLoop))]
    with torch.no_grad():
        if model_type is CumsumStep:
            assert loops == []
            assert torch.equal(default(x), unrolled(x))
            return
        assert [type(m) for m in loops] == [NativeProgramLoop]
        if model_type is NormedScan:  # a float step: float rounding only
            assert qt.sqnr(unrolled(x), default(x)) > 80
        else:  # int8 steps, one grid for all steps folded (one per step unrolled): as close
            assert qt.sqnr(model(x), default(x)) > qt.sqnr(model(x), unrolled(x)) - 3 > 10
        for length in (1, 17, 40):  # captured at 9; the toys' own accuracy is about 10-13 dB
            y = torch.randn(2, length, width)
            assert default(y).shape == model(y).shape
            assert qt.sqnr(model(y), default(y)) > 8


class OuterScan(nn.Module):
    """Mamba-1's sequential scan in miniature with no norm and no ``exp``: every op of its
    folded step is int8, and the outer products ``A dt`` and ``dt x`` move into the step
    (``recurrent/unrolled/sink.py``, a fixed batch): int8 binaries with a column operand."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.rand(4, 3) * 0.9)
        self.proj = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 5]
        dt = torch.sigmoid(self.proj(x)).transpose(1, 2)  # [B, 4, T]
        decay = self.a[None, :, None, :] * dt[..., None]  # [B, 4, T, 3], in (0, 0.9)
        drive = dt[..., None] * x[:, None, :, :3]  # [B, 4, T, 3]
        return selective_scan(decay, drive, x)


def test_an_int8_step_with_moved_outer_products_stays_folded_and_one_program(monkeypatch):
    """``qt.quantize``'s default (``fold_loops=None``) keeps the folded loop where its int8
    step, outer products moved in, is one native program: the same bits as the step run op
    by op in Python, and as close to the reference graph as the lowering's int8 kernels are
    (SQNR > 30 dB, both from one calibration), at lengths other than the captured 9."""
    torch.manual_seed(0)
    model = OuterScan().eval()
    x = torch.randn(2, 9, 5)
    data = [(torch.randn(2, 9, 5),) for _ in range(3)]
    free_time = {"x": {1: torch.export.Dim.AUTO}}  # the batch fixed: the products move in
    kw = dict(backend="cpu", progress=False, dynamic_shapes=free_time)
    default = qt.quantize(model, (x,), data, **kw)
    loops = [m for m in default.modules() if isinstance(m, (StepLoop, NativeProgramLoop))]
    assert [type(m) for m in loops] == [NativeProgramLoop]
    code = loops[0].code.tolist()
    assert any(c[0] == 3 and c[5] in (2, 3) for c in code)  # BINARY with a column operand
    assert {c[0] for c in code} <= {0, 1, 3, 5, 13}  # quantize, dequantize, binary, copy,
    # int8 matmul: every op of the step int8
    with monkeypatch.context() as m:
        m.setattr(step_program, "fuse_regions", lambda *a, **k: 0)
        python = qt.quantize(
            model, (x,), data, backend="cpu", progress=False, dynamic_shapes=free_time,
            fold_loops=True,
        )  # fmt: skip
    assert [type(m) for m in python.modules() if isinstance(m, StepLoop)] == [StepLoop]
    captured = qt.capture(model, (x,), dynamic_shapes=free_time, fold_loops=True)
    prepared = qt.prepare(captured, qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    reference = qt.convert(prepared)
    for length in (1, 17, 40):
        y = torch.randn(2, length, 5)
        with torch.no_grad():
            got = default(y)
            assert torch.equal(got, python(y))  # the same int8 ops, natively
            assert qt.sqnr(reference(y), got) > 30


def test_a_native_loop_plans_its_call_per_layout_and_checks_again_when_a_table_changes(
    monkeypatch,
):
    """From its second call of a layout a ``NativeProgramLoop`` runs its plan
    (``cells/loop_plan.py``): the values of the op's full path (a fresh copy, no plan) at
    every length; a table changed in place sends the call through the full checks again."""
    low, _ = _light_gru()  # a fresh copy: no plan yet
    (loop,) = [m for m in low.modules() if isinstance(m, NativeProgramLoop)]
    calls_in_full = []
    monkeypatch.setattr(step_program, "checked_loop",
                        lambda *a: calls_in_full.append(1) or checked_loop(*a))  # fmt: skip
    with torch.no_grad():
        for steps in (9, 4, 9):
            x = torch.randn(2, steps, 6)
            first, planned = low(x), low(x)
            assert torch.equal(first, planned)
            assert torch.equal(planned, copy.deepcopy(low)(x))
    assert len(loop.plans) == 2 and not copy.deepcopy(loop).plans
    assert len(calls_in_full) == 2 + 3  # one per new layout here, one per fresh copy
    with torch.no_grad():
        saved = loop.code.clone()
        loop.code[0, 0] = 99
        with pytest.raises(qt.QuantreeError, match="opcode"):
            low(x)
        loop.code.copy_(saved)
        assert torch.equal(low(x), planned)


class GatedScan(TimeThirdScan):
    """``TimeThirdScan`` gated and projected as Mamba-1's mixer is: elementwise math on the
    scan's ``[B, D, T]`` output and on a ``[B, D, T]`` gate around the folded loop, which a
    whole-model program would otherwise compile at the captured length."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(5, 4)
        self.skip = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 5]
        y = super().forward(x)  # [B, 4, T]
        g = self.gate(x).transpose(1, 2)
        y = (y + g * self.skip[None, :, None]) * nn.functional.silu(g)
        return self.out(y.transpose(1, 2))


def test_a_freed_loop_graph_runs_at_other_lengths_with_the_programs_around_it():
    """Folding frees the length (the captured integers become the input's size); the graph's
    values then carry a length symbol, so no program around the loop is compiled for the
    captured length (on main before this, 5 and 40 steps failed with 'compiled for inputs of
    shapes [[1, 16, 5], ...]'). The lowered model follows its reference graph at every
    length: 30 dB (measured 39-50)."""
    torch.manual_seed(0)
    model = GatedScan().eval()
    x = torch.randn(1, 16, 5)
    data = [(torch.randn(1, 16, 5),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        low = qt.quantize(model, (x,), data, backend="cpu", progress=False)
    assert [m for m in low.modules() if isinstance(m, NativeProgramLoop)]
    (placeholder,) = [n for n in low.graph.nodes if n.op == "placeholder"]
    assert not isinstance(placeholder.meta["val"].shape[1], int)  # the length is a symbol
    reference = reference_of(low)
    assert reference is not None
    for length in (5, 16, 40):
        x = torch.randn(1, length, 5)
        with torch.no_grad():
            assert qt.sqnr(reference(x), low(x)) > 30, length


def test_a_size_that_is_not_linear_in_its_symbol_is_not_a_program_size():
    """``FloorDiv(s, 16)`` (a chunked scan's chunk count under a dynamic length) is not
    ``a + b s``: the region keeps its ATen ops; substituting 0 once raised ZeroDivisionError
    out of ``quantize``."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    from quantree.backends.cpu.passes.regions import _linear

    s = sympy.Symbol("s", integer=True, positive=True)
    assert _linear(FloorDiv(s, 16)) is None
    assert _linear(3 * s + 2) == (2, 3)
    assert _linear(sympy.Integer(7)) == (7, 0)


def test_a_program_reads_its_size_symbol_only_where_the_call_can():
    """The call resolves ``s`` from an input dimension ``a + b s`` with ``a >= 0``
    (``program_checks.symbol``); a region whose inputs all have ``a < 0`` (WaveRNN's
    ``200 s - 800`` samples) keeps its ATen ops instead of a program every call refuses."""
    import types

    import sympy

    from quantree.backends.cpu.passes.regions import _symbolic

    s = sympy.Symbol("s", integer=True, positive=True)
    x = object()
    for rows, binding in ((200 * s - 800, None), (200 * s + 8, [0, 0, 8, 200])):
        p = types.SimpleNamespace(slots=[(0, 0, 0, 8, 8, rows)])
        found = _symbolic(p, [x], {x: ((rows, 8), torch.float32)})  # type: ignore[arg-type,dict-item]
        assert (found and found[1]) == binding
