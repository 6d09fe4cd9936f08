"""Folding a Python loop over time that torch.export unrolled back into one StepLoop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import quantree as qt
from quantree.core.points import POINT_KEY
from quantree.recurrent.unrolled.fold import fold_loops
from quantree.recurrent.unrolled.step_loop import StepLoop


class CellLoopModel(nn.Module):
    """A GRUCell or LSTMCell stepped by hand; outputs stacked (optionally in reverse)."""

    def __init__(self, lstm: bool, reverse: bool = False) -> None:
        super().__init__()
        self.lstm, self.reverse = lstm, reverse
        self.cell = nn.LSTMCell(6, 8) if lstm else nn.GRUCell(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor):
        h = torch.zeros(x.shape[0], 8)
        c = torch.zeros(x.shape[0], 8)
        steps = range(x.shape[1] - 1, -1, -1) if self.reverse else range(x.shape[1])
        ys = []
        for t in steps:
            if self.lstm:
                h, c = self.cell(x[:, t], (h, c))
            else:
                h = self.cell(x[:, t], h)
            ys.append(h)
        if self.reverse:
            ys = ys[::-1]
        return self.out(torch.stack(ys, 1)), h


class LightGRULike(nn.Module):
    """Light-GRU's step (no reset gate, relu candidate), the input projection before the loop,
    per-step outputs collected by ``cat`` of ``unsqueeze``."""

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
            ys.append(h.unsqueeze(1))
        return torch.cat(ys, 1)


def _loops(gm: torch.fx.GraphModule) -> list[StepLoop]:
    return [m for m in gm.modules() if isinstance(m, StepLoop)]


def _ops(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if name in str(n.target))


def test_cell_loops_fold_into_one_loop_equal_to_the_unrolled_graph_at_any_length():
    torch.manual_seed(0)
    for model in (CellLoopModel(False), CellLoopModel(True, reverse=True)):
        model.eval()
        x = torch.randn(2, 9, 6)  # quantree.capture folds runs of 8 steps or more
        unrolled = qt.capture(model, (x,), fold_loops=False)
        folded = qt.capture(model, (x,))
        cell = "lstm_cell" if model.lstm else "gru_cell"
        assert _ops(unrolled, cell) == 9
        assert _ops(folded, cell) == 0 and len(_loops(folded)) == 1
        (loop,) = _loops(folded)
        # the step's cell op written out as cells mode's cell graph: its gates are points
        points = {n.meta.get(POINT_KEY) for n in loop.body.graph.nodes}
        assert _ops(loop.body, cell) == 0 and {"hidden", "state0"} <= points and loop.free
        # The step runs the cell written out (linears, chunk, sigmoid, tanh) where the unrolled
        # graph runs ATen's fused cell: the same math, but which elementwise loops vectorize
        # depends on the CPU's ISA and on the chunk's layout, so the two agree to float rounding
        # (a few ulp), not bit for bit.
        close = {"rtol": 1e-6, "atol": 1e-7}
        for a, b in zip(folded(x), unrolled(x), strict=True):
            torch.testing.assert_close(a, b, **close)
        for length in (3, 20):  # the loop iterates over the input's time dimension
            y = torch.randn(3, length, 6)
            for a, b in zip(folded(y), model(y), strict=True):
                torch.testing.assert_close(a, b, **close)


def test_a_folded_cell_loop_runs_as_one_native_cell_program_at_any_length(tmp_path):
    from quantree.backends import load, save
    from quantree.backends.cpu.cells.step_loop import NativeStepLoop

    torch.manual_seed(0)
    model = CellLoopModel(False).eval()
    data = [(torch.randn(2, 9, 6),) for _ in range(4)]
    low = qt.quantize(model, data[0], data, backend="cpu", progress=False)
    assert [type(m) for m in low.modules() if isinstance(m, NativeStepLoop)] == [NativeStepLoop]
    for length in (3, 30):
        y = torch.randn(2, length, 6)
        for a, b in zip(model(y), low(y), strict=True):
            assert qt.sqnr(a, b) > 20  # dB; int8 gates and states, every step
    save(low, tmp_path / "loop.pt2", data[0])  # only ops the loader reads
    loaded = load(tmp_path / "loop.pt2")
    for a, b in zip(loaded(*data[1]), low(*data[1]), strict=True):
        assert torch.equal(a, b)


def test_a_loop_of_other_steps_stays_unrolled_by_default_and_folds_when_asked():
    torch.manual_seed(0)
    model = LightGRULike().eval()
    x = torch.randn(2, 9, 6)
    with pytest.warns(qt.QuantreeWarning, match="fold_loops=True"):
        unrolled = qt.capture(model, (x,))  # its step would run op by op in Python
    assert not _loops(unrolled) and _ops(unrolled, "sigmoid") == 9
    folded = qt.capture(model, (x,), fold_loops=True)  # following the warning
    assert len(_loops(folded)) == 1
    assert torch.equal(folded(x), unrolled(x))


def test_light_gru_like_loop_folds_and_quantizes_with_the_step_annotated_once():
    torch.manual_seed(0)
    model = LightGRULike().eval()
    x = torch.randn(2, 9, 6)
    folded = qt.capture(model, (x,), fold_loops=True)
    (loop,) = _loops(folded)
    assert torch.equal(folded(x), model(x))
    assert _ops(loop.body, "sigmoid") == 1
    calibration = [(torch.randn(2, 9, 6),) for _ in range(4)]
    prepared = qt.prepare(folded, qt.Int8Quantizer())
    for args in calibration:
        prepared(*args)
    (body,) = [m.body for m in _loops(prepared)]
    observers = [m for m in body.modules() if isinstance(m, qt.Observer)]
    assert observers and _ops(prepared, "sigmoid") == 0  # one step, observed for every step
    ref = qt.convert(prepared)
    (ref_body,) = [m.body for m in _loops(ref)]
    assert _ops(ref_body, "quantize_per_tensor") > 0  # the step has its q/dq
    y = torch.randn(2, 25, 6)  # another length, through the lowered loop
    low = qt.lower(ref, "cpu")
    assert qt.sqnr(model(y), low(y)) > 20  # dB; int8 activations and weights


def test_without_repetition_nothing_folds():
    torch.manual_seed(0)

    class Distinct(nn.Module):  # the same ops per "step", but each step its own weights
        def __init__(self) -> None:
            super().__init__()
            self.cells = nn.ModuleList(nn.GRUCell(6, 8) for _ in range(8))

        def forward(self, x):
            h = torch.zeros(x.shape[0], 8)
            for t, cell in enumerate(self.cells):
                h = cell(x[:, t], h)
            return h

    x = torch.randn(2, 8, 6)
    gm = qt.capture(Distinct().eval(), (x,))
    assert not _loops(gm) and _ops(gm, "gru_cell") == 8
    # a decoder stepped a handful of times stays unrolled (one native call per step)
    short = qt.capture(CellLoopModel(False).eval(), (torch.randn(2, 5, 6),))
    assert not _loops(short) and _ops(short, "gru_cell") == 5


class WritesInPlace(nn.Module):
    """RecurrentGemma's RG-LRU scan: each step writes its state into its own slice of a
    preallocated tensor (``out[:, t] = h``, a ``copy_`` into a view), read after the loop.
    ``how`` picks a variant: ``select`` (the model's), ``reversed`` (``out[:, T-1-t]``),
    ``narrow`` (``out[:, t:t+1] = h[:, None]``), or ones that must stay unrolled:
    ``fixed`` (every step writes slice 0), ``shifted`` (slice ``t + 1`` of a longer buffer),
    ``overlap`` (``out[:, t:t+2]``), ``read`` (the step reads its slice before writing it),
    ``alias`` (the buffer is a view of another tensor the model returns too)."""

    def __init__(self, how: str = "select") -> None:
        super().__init__()
        self.how = how
        self.gate = nn.Linear(4, 4)
        self.inp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):  # [B, T, 4]
        a, u = torch.sigmoid(self.gate(x)), self.inp(x)
        steps, how = x.shape[1], self.how
        h = torch.zeros(x.shape[0], 4)
        base = torch.zeros(x.shape[0], steps * 4)
        out = torch.zeros(x.shape[0], steps + (how in ("shifted", "overlap")), 4)
        if how == "alias":
            out = base.view(x.shape[0], steps, 4)
        elif how == "read":
            out = u.clone()
        for t in range(steps):
            h = a[:, t] * h + (out[:, t] if how == "read" else u[:, t])
            if how in ("select", "read", "alias"):
                out[:, t] = h
            elif how == "reversed":
                out[:, steps - 1 - t] = h
            elif how == "narrow":
                out[:, t : t + 1] = h[:, None]
            elif how == "fixed":
                out[:, 0] = h
            elif how == "shifted":
                out[:, t + 1] = h
            elif how == "overlap":
                out[:, t : t + 2] = h[:, None]
        return (out, base) if how == "alias" else out


@pytest.mark.parametrize("how", ["select", "reversed", "narrow"])
def test_a_step_writing_its_own_slice_of_a_buffer_folds_into_the_loop_output(how):
    """The buffer after the loop is every step's value joined along the written dimension:
    the loop's collected output replaces it, with no write left, at any length. Equal up to
    float rounding: the sigmoid that only the loop reads moves into the step (``sink``), where
    ATen computes it on one step's slice (a vector tail can round the last bit differently)."""
    torch.manual_seed(0)
    model = WritesInPlace(how).eval()
    x = torch.randn(2, 9, 4)
    unrolled = qt.capture(model, (x,), fold_loops=False)
    folded = qt.capture(model, (x,), fold_loops=True)
    assert _ops(unrolled, "copy_") == 9
    (loop,) = _loops(folded)
    assert loop.free and _ops(folded, "copy_") == 0 and _ops(loop.body, "copy_") == 0
    buffers = [n for n in folded.graph.nodes if n.target == torch.ops.aten.zeros.default]
    assert [len(n.args[0]) for n in buffers] == [2, 2]  # h and base: the [B, T, 4] one is gone
    torch.testing.assert_close(folded(x), unrolled(x), rtol=1e-6, atol=1e-7)
    for length in (1, 17, 40):  # captured at 9
        y = torch.randn(3, length, 4)
        torch.testing.assert_close(folded(y), model(y), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["fixed", "shifted", "overlap", "read", "alias"])
def test_a_write_not_provably_the_loop_output_stays_unrolled(how):
    torch.manual_seed(0)
    model = WritesInPlace(how).eval()
    x = torch.randn(2, 9, 4)
    gm = qt.capture(model, (x,), fold_loops=True)
    assert not _loops(gm) and _ops(gm, "copy_") == 9
    got, want = gm(x), model(x)
    got, want = (got, want) if how == "alias" else ((got,), (want,))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # as unrolled


UNARY = (torch.tanh, torch.sigmoid, torch.relu, torch.exp, nn.functional.softplus)


class RandomStep(nn.Module):
    """A random step body: ``ops`` (unary op indices, or -1 for ``* w``/``+ state``) over
    ``x_t`` and the carried state, stepped ``length`` times (or unshared: every step its own
    constants, so no two steps are isomorphic)."""

    def __init__(self, ops: list[int], shared: bool, length: int) -> None:
        super().__init__()
        self.ops = ops
        self.w = nn.ParameterList(
            nn.Parameter(torch.rand(5) * 0.5) for _ in range(1 if shared else length)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 5)
        ys = []
        for t in range(x.shape[1]):
            w = self.w[0] if len(self.w) == 1 else self.w[t]
            v = x[:, t] * w + h * 0.5
            for op in self.ops:
                v = v * w + h if op < 0 else UNARY[op](v)
            h = torch.tanh(v)
            ys.append(h)
        return torch.stack(ys, 1)


@settings(max_examples=8, deadline=None, phases=(Phase.explicit, Phase.generate))
@given(
    ops=st.lists(st.integers(-1, len(UNARY) - 1), min_size=1, max_size=4),
    length=st.integers(3, 6),
)
def test_random_step_bodies_fold_exactly_and_unshared_steps_do_not(ops, length):
    torch.manual_seed(0)
    x = torch.randn(2, length, 5)
    shared = RandomStep(ops, True, length).eval()
    gm = torch.export.export(shared, (x,)).module()
    unrolled_out = gm(x)
    assert fold_loops(gm) != []
    assert len(_loops(gm)) == 1 and torch.equal(gm(x), unrolled_out)
    unshared = RandomStep(ops, False, length).eval()
    gm2 = torch.export.export(unshared, (x,)).module()
    nodes = [(n.op, n.target, n.args) for n in gm2.graph.nodes]
    assert fold_loops(gm2) == []  # no two steps read the same constants: not a recurrence
    assert [(n.op, n.target, n.args) for n in gm2.graph.nodes] == nodes  # untouched


class ScanModel(nn.Module):
    """A recurrence written with torch's ``scan`` (``loop=True``: the same step as a Python
    ``for`` loop, the fix quantree's error for other loop operators names)."""

    def __init__(self, loop: bool = False) -> None:
        super().__init__()
        self.loop = loop
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.scan import scan

        def step(h, xt):
            h = torch.tanh(self.lin(xt) + h)
            return h, h.clone()

        h = torch.zeros(x.shape[1], 4)
        if self.loop:
            ys = []
            for t in range(x.shape[0]):
                h, y = step(h, x[t])
                ys.append(y)
            return torch.stack(ys)
        return scan(step, h, x)[1]


class WhileModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.while_loop import while_loop

        def cond(i, h):
            return i < 3

        def body(i, h):
            return i + 1, torch.tanh(h + 1)

        return while_loop(cond, body, (torch.tensor(0), x))[1]


def test_scan_becomes_the_same_loop_and_while_loop_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = ScanModel().eval()
    gm = qt.capture(model, (torch.randn(5, 2, 4),))
    (loop,) = _loops(gm)
    assert not any("scan" in str(n.target) for n in gm.graph.nodes)
    assert any(n.op == "get_attr" for n in loop.body.graph.nodes)  # the weight is the body's
    for length in (5, 9):
        x = torch.randn(length, 2, 4)
        # scan's eager kernel and the loop differ in the last bit of a linear's sum
        torch.testing.assert_close(gm(x), model(x), atol=1e-6, rtol=0)
    with pytest.raises(qt.QuantreeError, match=r"higher_order\.while_loop.*Python `for` loop"):
        qt.capture(WhileModel().eval(), (torch.randn(2, 4),))
    fixed = ScanModel(loop=True).eval()  # the fix the error names: a Python for loop
    x = torch.randn(9, 2, 4)
    folded = qt.capture(fixed, (x,), fold_loops=True)
    assert len(_loops(folded)) == 1 and torch.equal(folded(x), fixed(x))
