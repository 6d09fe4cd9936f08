"""Cells mode, natively: a lowered cell body compiled into a program run for all steps in C.

After the CPU rules have lowered a cell body, what is left is a handful of native ops on
[batch, features] tensors (quantize, linear, add/mul, table lookups, chunk, dequantize), and,
where a point is quantized to a type the int8 rules leave alone (an int16 cell state or
gate), reference quantize -> dequantize pairs around float add/mul/sigmoid/tanh. This
module records the body once with example inputs, gives every value a slice of one
workspace (a chunk's pieces are views of their source), and encodes each op as a fixed-size
record. ``torch.ops.quantree.cell_loop`` then runs the program for every time step in one
native call: the arithmetic of each op is the same as its op's, only the per-step Python
and dispatch go away. Bodies with anything else keep their Python loop.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from quantree.backends.cpu.cells.runner import CellLoopRunner, kernels
from quantree.backends.cpu.native import checks as native_checks
from quantree.backends.cpu.native import program_checks
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.native.registry import op

NI, NF = 12, 8  # int and float fields per instruction (csrc/cells.cpp)
QUANT, DEQUANT, LINEAR, BINARY, LOOKUP, COPY, FAKE_QUANT, FLOAT_BINARY, FLOAT_UNARY = range(9)
LINEAR16 = 10
BINARY_KINDS = {"add": 0, "mul": 1, "sub": 2}
aten = torch.ops.aten
FLOAT_BINARY_KINDS = {aten.add.Tensor: 0, aten.mul.Tensor: 1, aten.sub.Tensor: 2}
FLOAT_UNARY_KINDS = {aten.sigmoid.default: 0, aten.tanh.default: 1, aten.relu.default: 2}
quantree_ops = torch.ops.quantree
qd = torch.ops.quantized_decomposed


@dataclass
class Program:
    # Per slot: dtype (0 f32, 1 i8), the slot owning the storage, byte offset inside its
    # rows, cols, row stride. Rows are the batch, known only when the loop runs, so the
    # workspace is laid out per call (csrc/cells.cpp) and one program serves every batch size.
    slots: list[list[int]] = field(default_factory=list)
    code: list[list[int]] = field(default_factory=list)
    fcode: list[list[float]] = field(default_factory=list)
    consts: list[Tensor] = field(default_factory=list)
    outs: list[int] = field(default_factory=list)

    def alloc(self, dtype: torch.dtype, cols: int) -> int:
        index = len(self.slots)
        self.slots.append([0 if dtype == torch.float32 else 1, index, 0, cols, cols])
        return index

    def view(self, source: int, first_col: int, cols: int) -> int:
        """Columns ``first_col:first_col + cols`` of ``source``, sharing its storage."""
        dtype, base, offset, _, ld = self.slots[source]
        elem = 4 if dtype == 0 else 1
        self.slots.append([dtype, base, offset + first_col * elem, cols, ld])
        return len(self.slots) - 1

    def emit(self, ints: list[int], floats: list[float]) -> None:
        self.code.append(ints + [0] * (NI - len(ints)))
        self.fcode.append(floats + [0.0] * (NF - len(floats)))


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}

    def run_node(self, n: fx.Node) -> object:
        result = super().run_node(n)
        self.values[n] = result
        return result


def compile_body(body: fx.GraphModule, example: tuple[Tensor, ...]) -> Program | None:
    """The program computing ``body`` (None if it holds an op the program cannot run)."""
    recorder = _Recorder(body)
    with torch.no_grad():
        recorder.run(*example)
    values = recorder.values
    p = Program()
    slot: dict[fx.Node, int] = {}
    const: dict[fx.Node, int] = {}
    pieces: dict[fx.Node, list[int]] = {}

    def value_slot(n: fx.Node) -> int | None:
        v = values.get(n)
        if not isinstance(v, Tensor) or v.dim() != 2 or v.dtype not in (torch.float32, torch.int8):
            return None
        return p.alloc(v.dtype, v.shape[1])

    def const_index(n: object) -> int:
        if n is None:
            return -1
        assert isinstance(n, fx.Node)
        if n not in const:
            const[n] = len(p.consts)
            p.consts.append(torch.as_tensor(values[n]).contiguous())
        return const[n]

    for n in body.graph.nodes:  # inputs first: slot 0 is x_t, then the states in order
        if n.op == "placeholder":
            s = value_slot(n)
            if s is None or p.slots[s][0] != 0:  # float inputs only
                return None
            slot[n] = s
    for n in body.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        elif n.op == "output":
            outs = n.args[0]
            if not isinstance(outs, list | tuple) or not all(o in slot for o in outs):
                return None
            p.outs = [slot[o] for o in outs]
        elif n.target == torch.ops.aten.chunk.default:
            a: Any = n.args
            src, chunks = a[0], a[1]
            dim = a[2] if len(a) > 2 else 0
            if src not in slot or dim not in (-1, 1):
                return None
            width = p.slots[slot[src]][3] // chunks
            pieces[n] = [p.view(slot[src], i * width, width) for i in range(chunks)]
        elif n.target is operator.getitem and n.args[0] in pieces:
            g: Any = n.args
            slot[n] = pieces[g[0]][g[1]]
        elif not emit(p, n, slot, value_slot, const_index):
            return None
    n_states = len(example) - 1
    if len(p.outs) != n_states or any(p.slots[s][0] != 0 for s in p.outs):
        return None
    return p


def emit(
    p: Program,
    n: fx.Node,
    slot: dict[fx.Node, int],
    value_slot: Callable[[fx.Node], int | None],
    const_index: Callable[[object], int],
) -> bool:
    """Append the instruction computing ``n``; False if ``n`` is not one the program runs."""
    args: Any = n.args
    ints: list[int]
    floats: list[float]
    if n.target == quantree_ops.quantize.default and args[0] in slot:
        ints, floats = [QUANT, 0, slot[args[0]]], [1.0 / args[1], float(args[2])]
    elif n.target == quantree_ops.dequantize.default and args[0] in slot:
        ints, floats = [DEQUANT, 0, slot[args[0]]], [float(args[1]), float(args[2])]
    elif n.target == quantree_ops.linear.default and args[0] in slot:
        weight = const_index(args[1])
        ints = [LINEAR, 0, slot[args[0]], weight, const_index(args[3]), const_index(args[4])]
        ints += [const_index(args[2]), 0, int(args[5]), packed_depth(p.consts[weight])]
        ints += [int(bool(args[8]))]
        floats = [float(args[6]), float(args[7])]
    elif (
        n.target == quantree_ops.linear16.default
        and args[0] in slot
        and p.slots[slot[args[0]]][0] == 0
    ):
        weight = const_index(args[4])
        ints = [LINEAR16, 0, slot[args[0]], weight, const_index(args[6]), const_index(args[7])]
        ints += [const_index(args[5]), 0, int(args[8]), packed_depth(p.consts[weight])]
        floats = [1.0 / args[1], float(args[2]), float(args[3])]
    elif n.target == quantree_ops.binary.default and args[1] in slot and args[2] in slot:
        a, b = p.slots[slot[args[1]]], p.slots[slot[args[2]]]
        grids = [float(args[3]), float(args[4]), float(args[5]), float(args[6])]
        first, second = slot[args[1]], slot[args[2]]
        one = _one_value(p, second, first)  # b of one element, broadcast: the flag c[5]
        if _one_value(p, first, second) and args[0] in ("add", "mul"):  # swapped: a op b = b op a
            first, second, grids, one = second, first, grids[2:] + grids[:2], True
        if (a[3] != b[3] and not one) or args[0] not in BINARY_KINDS:
            return False
        ints = [BINARY, 0, first, second, BINARY_KINDS[args[0]], int(one)]
        floats = [*grids, 1.0 / args[7], float(args[8])]
    elif n.target == quantree_ops.lookup.default and args[0] in slot:
        ints, floats = [LOOKUP, 0, slot[args[0]], const_index(args[1])], []
    elif n.target == qd.quantize_per_tensor.default:
        # emitted with its dequantize users (a fake quantization in float): the integer
        # tensor itself never needs a slot.
        return all(_fake_quant_source(u) is n for u in n.users)
    elif (source := _fake_quant_source(n)) is not None and source.args[0] in slot:
        _, scale, zero_point, qmin, qmax = args[:5]
        ints = [FAKE_QUANT, 0, slot[source.args[0]]]  # type: ignore[index]
        floats = [1.0 / scale, float(zero_point), float(qmin), float(qmax), float(scale)]
    elif n.target in FLOAT_BINARY_KINDS and not n.kwargs and _float_pair(p, slot, args):
        ints, floats = [FLOAT_BINARY, 0, slot[args[0]], slot[args[1]]], []
        ints.append(FLOAT_BINARY_KINDS[n.target])  # type: ignore[index]
    elif n.target in FLOAT_UNARY_KINDS and args[0] in slot and p.slots[slot[args[0]]][0] == 0:
        ints = [FLOAT_UNARY, 0, slot[args[0]], FLOAT_UNARY_KINDS[n.target]]  # type: ignore[index]
        floats = []
    else:
        return False
    dst = value_slot(n)
    if dst is None:
        return False
    slot[n] = dst
    ints[1] = dst
    p.emit(ints, floats)
    return True


def _fake_quant_source(n: fx.Node) -> fx.Node | None:
    """The per-tensor quantize that ``n`` dequantizes with the same parameters, if any."""
    if n.target != qd.dequantize_per_tensor.default or not isinstance(n.args[0], fx.Node):
        return None
    source = n.args[0]
    same = source.target == qd.quantize_per_tensor.default and source.args[1:6] == n.args[1:6]
    scalars = all(isinstance(a, int | float) for a in n.args[1:5])
    to_float = n.kwargs.get("out_dtype") in (None, torch.float32)
    return source if same and scalars and to_float else None


def _float_pair(p: Program, slot: dict[fx.Node, int], args: Any) -> bool:
    """Two float values of one shape (no broadcasting, no scalars)."""
    if len(args) != 2 or args[0] not in slot or args[1] not in slot:
        return False
    a, b = p.slots[slot[args[0]]], p.slots[slot[args[1]]]
    return a[0] == b[0] == 0 and a[3] == b[3]


class NativeCellLoop(nn.Module):
    """Drop-in for a cells-mode loop: ``(xs, state) -> (outputs, final state)``."""

    quantree_read_only_buffers = True  # the program and its constants (core.constants)

    def __init__(self, program: Program, reverse: bool) -> None:
        super().__init__()
        self.reverse = reverse
        self.n_consts = len(program.consts)
        for i, c in enumerate(program.consts):
            self.register_buffer(f"const{i}", c)
        self.register_buffer("code", torch.tensor(program.code, dtype=torch.int64))
        self.register_buffer("fcode", torch.tensor(program.fcode, dtype=torch.float32))
        self.register_buffer("slots", torch.tensor(program.slots, dtype=torch.int64))
        self.register_buffer("outs", torch.tensor(program.outs, dtype=torch.int64))
        self.const_names = tuple(f"const{i}" for i in range(self.n_consts))
        self.runner = CellLoopRunner()

    def program(self) -> tuple[list[Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]:
        """The constants and ``(code, fcode, slots, outs)`` as the module holds them now,
        read from ``_buffers`` (``Module.__getattr__`` searches three dictionaries a name)."""
        buffers: Any = self._buffers
        consts = [buffers[name] for name in self.const_names]
        return consts, (buffers["code"], buffers["fcode"], buffers["slots"], buffers["outs"])

    def ready(self) -> tuple[int, ...]:
        """The runner prepared for the module's tensors; the input and state widths."""
        return self.runner.ready(*self.program())

    def forward(
        self, xs: Tensor, state: tuple[Tensor, ...], batch_sizes: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``batch_sizes``: ``xs`` are a packed sequence's rows (one native loop per length).

        Plain tensors run on the module's ``CellLoopRunner`` (the op's arithmetic, without
        the dispatcher and the per-call argument block); anything else (the fake tensors of
        ``torch.export`` when the model is saved) goes through the op, so saved programs
        hold ``quantree.cell_loop``."""
        if batch_sizes is None and type(xs) is Tensor and all(type(s) is Tensor for s in state):
            ys, *final = self.runner(xs, state, *self.program(), self.reverse)
            return ys, tuple(final)
        consts = [getattr(self, f"const{i}") for i in range(self.n_consts)]
        program = (self.code, self.fcode, self.slots, self.outs, self.reverse)
        if batch_sizes is None:
            ys, *final = quantree_ops.cell_loop(xs, list(state), consts, *program)
        else:
            ys, *final = quantree_ops.cell_loop_packed(
                xs, batch_sizes, list(state), consts, *program
            )
        return ys, tuple(final)


@op(
    "cell_loop(Tensor xs, Tensor[] state, Tensor[] consts, Tensor code, Tensor fcode, "
    "Tensor slots, Tensor outs, bool reverse) -> Tensor[]"
)
def cell_loop(
    xs: Tensor,
    state: list[Tensor],
    consts: list[Tensor],
    code: Tensor,
    fcode: Tensor,
    slots: Tensor,
    outs: Tensor,
    reverse: bool,
) -> list[Tensor]:
    """Run a compiled cell program over ``xs`` [T, B, I]: ``[ys, *final_states]``."""
    op_name = "cell_loop"
    if xs.dim() != 3 or not state:
        raise native_checks.fail(
            op_name,
            f"xs has shape {tuple(xs.shape)} and {len(state)} states; the kernel reads "
            "[T, B, I] and at least one state",
        )
    io_bytes = 4 * (xs.numel() + sum(s.numel() for s in state))
    program_checks.cell_loop(len(state), consts, code, fcode, slots, outs, xs.shape[1], io_bytes)
    xs = xs.float().contiguous()
    finals = [s.float().contiguous().clone() for s in state]
    widths = [int(w) for w in slots[: 1 + len(finals), 3]]
    shapes = [tuple(xs.shape[1:]), *(tuple(f.shape) for f in finals)]
    if shapes != [(xs.shape[1], w) for w in widths]:
        raise native_checks.fail(
            op_name,
            f"compiled for [batch, {widths[0]}] inputs and states of widths "
            f"{widths[1:]}, got input {tuple(xs.shape)} and states {shapes[1:]}",
        )
    ys = torch.empty(xs.shape[0], xs.shape[1], finals[0].shape[-1])
    a = NativeArgs(op_name)  # every address below points into a tensor ``a`` holds
    kernels().qt_cell_loop(
        a.input("xs", xs), a.output("ys", ys), xs.shape[0], int(reverse),
        a.outputs("state", finals), len(finals), a.input("outs", outs),
        a.input("slots", slots), slots.shape[0], xs.shape[1], a.input("code", code),
        a.input("fcode", fcode), code.shape[0], a.inputs("consts", consts),
    )  # fmt: skip
    return [ys, *finals]


@torch.library.register_fake("quantree::cell_loop")
def _(xs, state, consts, code, fcode, slots, outs, reverse):
    ys = xs.new_empty((xs.shape[0], xs.shape[1], state[0].shape[-1]), dtype=torch.float32)
    return [ys, *[torch.empty_like(s, dtype=torch.float32) for s in state]]


@op(
    "cell_loop_packed(Tensor xs, Tensor batch_sizes, Tensor[] state, Tensor[] consts, "
    "Tensor code, Tensor fcode, Tensor slots, Tensor outs, bool reverse) -> Tensor[]"
)
def cell_loop_packed(
    xs: Tensor,
    batch_sizes: Tensor,
    state: list[Tensor],
    consts: list[Tensor],
    code: Tensor,
    fcode: Tensor,
    slots: Tensor,
    outs: Tensor,
    reverse: bool,
) -> list[Tensor]:
    """``cell_loop`` on a packed sequence's rows ``xs`` [N, I]: ``[ys [N, H], *finals]``.

    One op rather than Python around ``cell_loop``: how many rows each step has depends on
    ``batch_sizes``' values, which ``torch.export`` (so ``quantree.backends.save``) cannot
    trace; as an op with a fake kernel it is one node. One native call runs every step on
    the sequences still running at it (``qt_cell_loop_packed``); one loop per group of
    equal lengths ran a batch of 4 sequences of different lengths as 4 loops of one row,
    slower than float PyTorch's packed GRU (the outside models' ``gru_packed``).
    """
    if xs.dim() != 2 or not state:
        raise native_checks.fail(
            "cell_loop_packed",
            f"xs of shape {tuple(xs.shape)} are not a packed sequence's rows, or no state",
        )
    sizes = native_checks.packed_batch_sizes("cell_loop_packed", batch_sizes, xs.shape[0])
    batch = sizes[0]
    io_bytes = 4 * (xs.numel() + sum(s.numel() for s in state))
    program_checks.cell_loop(len(state), consts, code, fcode, slots, outs, batch, io_bytes)
    xs = xs.float().contiguous()
    finals = [s.float().contiguous().clone() for s in state]
    widths = [int(w) for w in slots[: 1 + len(finals), 3]]
    shapes = [(xs.shape[1],), *(tuple(f.shape) for f in finals)]
    if shapes != [(widths[0],), *((batch, w) for w in widths[1:])]:
        raise native_checks.fail(
            "cell_loop_packed",
            f"compiled for [*, {widths[0]}] inputs and states of widths "
            f"{widths[1:]}, got input {tuple(xs.shape)} and states {shapes[1:]} for a batch "
            f"of {batch}",
        )
    ys = xs.new_empty((xs.shape[0], widths[1]))
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    a = NativeArgs("cell_loop_packed")  # every address below points into a tensor it holds
    kernels().qt_cell_loop_packed(
        a.input("xs", xs), a.output("ys", ys), len(sizes), int(reverse),
        a.input("batch_sizes", sizes_t), a.outputs("state", finals), len(finals),
        a.input("outs", outs), a.input("slots", slots), slots.shape[0], batch,
        a.input("code", code), a.input("fcode", fcode), code.shape[0],
        a.inputs("consts", consts),
    )  # fmt: skip
    return [ys, *finals]


@torch.library.register_fake("quantree::cell_loop_packed")
def _(xs, batch_sizes, state, consts, code, fcode, slots, outs, reverse):
    ys = xs.new_empty((xs.shape[0], state[0].shape[-1]), dtype=torch.float32)
    return [ys, *[torch.empty_like(s, dtype=torch.float32) for s in state]]


def _one_value(p: Program, x: int, other: int) -> bool:
    """Whether slot ``x`` holds one element and ``other`` more (a broadcast scalar tensor,
    such as an eval-mode dropout mask of ones): region programs' slots, which record rows."""
    sx, so = p.slots[x], p.slots[other]
    if len(sx) < 6 or len(so) < 6:
        return False
    return sx[3] == 1 and sx[5] == 1 and (so[3] != 1 or not (isinstance(so[5], int) and so[5] == 1))
