"""Strided tensors reaching the native kernels (``native/args.py``: ``NativeArgs``), and raw errors
under every op turned into ``NativeArgumentError`` (``registry.contract_errors``).

A non-contiguous state or weight (a weight stored with doubled strides in a file, an
``expand``-ed state, a direct op call with a transposed view) must give exactly the numbers
its contiguous copy gives, or a ``NativeArgumentError``: the dense copy the op makes lives
through the C call. The calls are real lowered models' ``torch.ops.quantree`` calls,
recorded through the dispatcher.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.checks import NativeArgumentError
from quantree.backends.cpu.native.direct import DirectCall
from quantree.backends.cpu.ops.recurrent.rnn import RnnRunner

ops = torch.ops.quantree
CPU_DIR = Path(qt.__file__).parent / "backends" / "cpu"


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.namespace == "quantree":
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def recorded(model: nn.Module, args: tuple, quantizer: qt.Quantizer, name: str) -> tuple:
    """The arguments of the first ``quantree.<name>`` call of ``model`` lowered."""
    torch.manual_seed(0)
    data = [tuple(a + 0.1 * i for a in args) for i in range(3)]
    low = qt.lower(qt.quantize(model.eval(), args, data, quantizer=quantizer, progress=False), CPU)
    for module in low.modules():  # direct calls back to the ops: the recorder sees them
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if isinstance(node.target, DirectCall):
                    node.target = node.target.op
            module.recompile()
    recorder = Recorder()
    with torch.no_grad(), recorder:
        low(*args)
    return next(a for f, a in recorder.calls if f._schema.name == f"quantree::{name}")


def doubled(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose last dimension steps by 2 (a doubled stride), the
    elements between them garbage that a kernel reading it as dense would take."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 77, dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def lstm_call() -> tuple:
    x, h0, c0 = torch.randn(5, 2, 8), torch.randn(1, 2, 16), torch.randn(1, 2, 16)

    class WithState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16)

        def forward(self, x, h, c):
            return self.lstm(x, (h, c))

    return recorded(WithState(), (x, h0, c0), qt.Int8Quantizer(), "rnn")


@pytest.fixture(scope="module")
def cell_call() -> tuple:
    """``quantree.cell_loop``'s arguments for a GRU's compiled cells-mode loop (in memory the
    loop runs on its module's runner; a saved model calls the op)."""
    torch.manual_seed(0)
    cells = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    args = (torch.randn(5, 2, 8),)
    data = [tuple(a + 0.1 * i for a in args) for i in range(3)]
    low = qt.lower(qt.quantize(nn.GRU(8, 16).eval(), args, data, quantizer=cells,
                               progress=False), CPU)  # fmt: skip
    loop = next(m for m in low.modules() if hasattr(m, "runner") and hasattr(m, "program"))
    consts, (code, fcode, slots, outs) = loop.program()
    widths = [int(w) for w in slots[: 1 + outs.shape[0], 3]]
    state = [torch.randn(2, w) for w in widths[1:]]
    return torch.randn(5, 2, widths[0]), state, consts, code, fcode, slots, outs, False


def test_strided_states_of_an_rnn_give_the_dense_result(lstm_call: tuple) -> None:
    args = list(lstm_call)
    want = ops.rnn(*args)
    args[2] = [doubled(h) for h in args[2]]  # h_0 and c_0 with doubled strides
    for _ in range(3):  # the freed copy's block was reused by the kernel's workspace
        assert same(ops.rnn(*args), want)


def test_a_weight_with_doubled_strides_gives_the_dense_result(lstm_call: tuple) -> None:
    args = list(lstm_call)
    want = ops.rnn(*args)
    args[3] = [doubled(p) if p.dim() == 3 else p for p in args[3]]  # the packed weights
    assert same(ops.rnn(*args), want)


def test_strided_cell_loop_constants_give_the_dense_result(cell_call: tuple) -> None:
    args = list(cell_call)
    want = ops.cell_loop(*args)
    args[1] = [doubled(s) for s in args[1]]
    args[2] = [doubled(c) if c.dim() >= 1 and c.numel() > 1 else c for c in args[2]]
    for _ in range(3):
        assert same(ops.cell_loop(*args), want)


def test_a_stride_0_weight_is_a_clean_error_or_the_dense_result() -> None:
    weight = torch.ones(1, 2, 64, dtype=torch.int8).expand(1, 2, 64)  # dense: fine
    x = torch.ones(3, 8, dtype=torch.int8)
    offset, scale = torch.zeros(16, dtype=torch.int32), torch.ones(16)
    want = ops.linear(x, weight.contiguous(), offset, scale, None, 16, 0.0, 0, False)
    broadcast = torch.ones(1, 1, 64, dtype=torch.int8).expand(1, 2, 64)  # stride 0
    assert broadcast.stride()[1] == 0
    assert torch.equal(ops.linear(x, broadcast, offset, scale, None, 16, 0.0, 0, False), want)


def test_raw_errors_are_native_argument_errors_naming_the_op_and_argument(
    cell_call: tuple,
) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(NativeArgumentError, match=r"quantree\.quantize: scale 0\.0"):
        ops.quantize(x, 0.0, 0)
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(NativeArgumentError, match=r"quantree\.softmax: out_scale 0\.0"):
        ops.softmax(q, torch.ones(256), 0.0, 0)
    with pytest.raises(NativeArgumentError, match=r"quantree\.binary: out_scale 0\.0"):
        ops.binary("add", q, q, 1.0, 0, 1.0, 0, 0.0, 0)
    args = list(cell_call)
    args[0] = args[0][0, 0]  # a 1-d activation
    with pytest.raises(NativeArgumentError, match=r"quantree\.cell_loop: xs has shape \(8,\)"):
        ops.cell_loop(*args)
    program = torch.zeros(0, 12, dtype=torch.int64), torch.zeros(0, 8)
    slots, ins, outs = torch.tensor([[0, 0, 0, 4, 4, 1]]), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(NativeArgumentError, match=r"quantree\.program: out_dtypes \[7\]"):
        ops.program([x[:1, :4]], [], *program, slots, ins, outs, [1, 4], [2], [1, 4], [2], [7])


def test_a_lowered_graphs_own_rnn_runner_raises_native_argument_errors_too(
    lstm_call: tuple,
) -> None:
    """The per-node runner a lowered (or loaded) graph calls without the dispatcher."""
    args = list(lstm_call)
    args[1], args[7] = args[1][0, 0], True  # a 1-d activation, batch first
    with pytest.raises(NativeArgumentError, match=r"quantree\.rnn: .*IndexError"):
        RnnRunner()(*args)


def test_an_error_no_contract_names_is_still_a_native_argument_error() -> None:
    table = torch.zeros(3, 4, dtype=torch.int8)
    scale, zp = torch.ones(3), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(NativeArgumentError, match=r"quantree\.embedding_rows: .*IndexError"):
        ops.embedding_rows(table, scale, zp, torch.tensor([5]), True)


def _temporaries(path: Path) -> list[str]:
    """``ptr(<call>)`` / ``<call>.data_ptr()`` in ``path``: an address taken of a tensor made
    inside the expression, which dies before the C call it is for."""
    found = []
    views = {"in_memory_order"}  # a view of a live local, not a new tensor
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "ptr" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Call) and getattr(arg.func, "id", None) not in views:
                found.append(f"{path.relative_to(CPU_DIR)}:{node.lineno}")
        if isinstance(func, ast.Attribute) and func.attr == "data_ptr":
            value = func.value
            if isinstance(value, ast.Call) and getattr(value.func, "attr", "") != "untyped_storage":
                found.append(f"{path.relative_to(CPU_DIR)}:{node.lineno}")
    return found


def test_no_address_is_taken_of_a_temporary() -> None:
    found = [hit for path in sorted(CPU_DIR.rglob("*.py")) for hit in _temporaries(path)]
    assert found == []
