"""Chains of lowered layers run as one native call (``csrc/chain.cpp``).

Over 400 lines: finding a chain, planning it from its first call and running or falling
back share one plan record whose invariants (layouts, constants' identities) are checked in
one place; split, each half would re-derive them.

A small CNN lowered for batch 1 is a straight line of native calls: quantize, a few
convolutions, a flatten, a linear, dequantize. Each call's arithmetic is a few microseconds;
the Python around it (the generated forward's line, the bound call's guards, ``contiguous``,
``torch.empty``, a ctypes call of twenty-odd arguments) costs as much again, and under load
more. Here each maximal chain of such nodes (each one's data input the previous one's output,
read by it alone) runs as one ctypes call over the same kernels with the arguments each op
would pass, the intermediate tensors in a per-thread workspace.

The graph is not changed: the chains are fused in a copy of it whose code becomes the module's
``forward``; ``model.graph`` and ``model.code`` still show every op (what tools and tests read),
and a ``recompile`` of the module (a user's own pass) goes back to the per-op forward. A chain
runs its ops one by one, as the per-op forward does, on its first call for an input layout
(checking each op's contract through its bound call) and whenever anything differs from what
its native plan was made from: the input's dtype, shape or strides, a constant replaced or
changed in place, tensors that are not plain (``torch.export``'s fake ones when the model is
saved, so a saved program holds the ops themselves).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.graph_module import _forward_from_src

from quantree.backends.cpu.native.direct import BoundCall, DirectCall
from quantree.backends.cpu.native.loader import I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.ops.elementwise import BINARY as BINARY_KINDS

SIGNATURES: dict[str, list[type]] = {"qt_chain_run": [PTR, PTR, I64, PTR, I64, I64, PTR, I64, PTR]}
kernels = native_kernels(SIGNATURES)

WIDTH = 32
"""int64 fields of one step (``csrc/chain.cpp``: kind, input buffer, output buffer, args)."""
QUANTIZE, DEQUANTIZE, TO_CHANNELS_LAST, TO_CONTIGUOUS = 0, 1, 2, 3
CONV, CONV_DEPTHWISE, LINEAR, MAX_POOL, LOOKUP, BINARY = 4, 5, 6, 7, 8, 9
OPS = ("quantize", "dequantize", "conv2d", "linear", "max_pool2d", "lookup", "binary")
"""quantree ops a chain runs natively."""
VIEWS = (torch.ops.aten.flatten.using_ints, torch.ops.aten.view.default,
         torch.ops.aten.reshape.default)  # fmt: skip
"""Reshapes a chain runs inside it (a copy into contiguous order where torch copies)."""
PLANS_KEPT = 8
"""Input layouts a chain keeps a native plan for (a model sees few)."""
UNSEEN: Any = object()
"""``ChainCall.plans``' answer for a layout not planned yet."""
_VERSION = operator.attrgetter("_version")


def op_name(node: fx.Node) -> str | None:
    """The quantree op a direct call runs (``conv2d``...), or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, DirectCall):
        return None
    return target.op._schema.name.split("::")[1]


def data_positions(node: fx.Node) -> tuple[int, ...]:
    """Where ``node`` reads activations: ``binary``'s two operands, else argument 0."""
    return (1, 2) if op_name(node) == "binary" else (0,)


def chainable(node: fx.Node) -> bool:
    """Whether ``node`` can be a step: a supported op or reshape, its activations graph
    values, every other graph value it reads a constant (``get_attr``)."""
    if node.op != "call_function" or node.kwargs:
        return False
    if op_name(node) not in OPS and node.target not in VIEWS:
        return False
    data = data_positions(node)
    if len(node.args) <= max(data) or not all(isinstance(node.args[i], fx.Node) for i in data):
        return False
    if len(data) == 2 and node.args[0] != "add":
        return False  # a product is often a broadcast (a squeeze-excitation's scale), which
        # the native step does not do; a residual add is of two maps of one shape
    found: list[fx.Node] = []
    _map([a for i, a in enumerate(node.args) if i not in data], found.append)
    return all(n.op == "get_attr" for n in found)


def find_chains(graph: fx.Graph) -> list[list[fx.Node]]:
    """Maximal runs of chainable nodes, each reading the previous one's output, which
    nothing else reads (a residual add's other operand may come from anywhere before it);
    no reshape first or last (it would alias the chain's input or be its output); at least
    two steps."""
    chains: list[list[fx.Node]] = []
    taken: set[fx.Node] = set()
    for node in graph.nodes:
        if node in taken or not chainable(node):
            continue
        chain = [node]
        while len(chain[-1].users) == 1:
            (user,) = chain[-1].users
            ok = user not in taken and chainable(user)
            reads = [user.args[i] for i in data_positions(user)] if ok else []
            if chain[-1] not in reads or reads.count(chain[-1]) > 1:
                break
            chain.append(user)
        while chain and chain[0].target in VIEWS:
            chain.pop(0)
        while chain and chain[-1].target in VIEWS:
            chain.pop()
        if len(chain) >= 2:
            chains.append(chain)
            taken.update(chain)
    return chains


class Ref:
    """A tensor a step reads: the chain's input ``input``, a constant (``constant``), or
    step ``step``'s output."""

    __slots__ = ("constant", "input", "step")

    def __init__(self, step: int = -1, constant: int = -1, input: int = -1) -> None:
        self.step, self.constant, self.input = step, constant, input


def _resolve(arg: Any, inputs: tuple, constants: tuple, outputs: list) -> Any:
    if isinstance(arg, Ref):
        if arg.constant >= 0:
            return constants[arg.constant]
        return inputs[arg.input] if arg.input >= 0 else outputs[arg.step]
    if isinstance(arg, list | tuple):
        return type(arg)(_resolve(a, inputs, constants, outputs) for a in arg)
    return arg


Step = tuple[list[int], tuple[float, ...]]
FLOATS = 6
"""floats of one step (``csrc/chain.cpp``)."""


class Plan:
    """A chain's native call for one input layout: the steps (int64 and float arrays), the
    buffer offsets, the output's shape, strides and dtype, the stamps of the constants
    (identity, version, data pointer) the pointers were taken from, and what keeps the
    checked storages alive."""

    def __init__(self, steps: list[Step], offsets: list[int], workspace: int, out: Tensor,
                 constants: tuple[Tensor, ...], keep: tuple[Any, ...]) -> None:  # fmt: skip
        ints = torch.zeros(len(steps), WIDTH, dtype=torch.int64)
        floats = torch.zeros(len(steps), FLOATS, dtype=torch.float32)
        for s, (fields, fs) in enumerate(steps):
            ints[s, : len(fields)] = torch.tensor(fields, dtype=torch.int64)
            floats[s, : len(fs)] = torch.tensor(fs, dtype=torch.float32)
        self.arrays = (ints, floats, torch.tensor(offsets, dtype=torch.int64))
        # converted once: ctypes passes its own instances as they are
        self.head = (PTR(ints.data_ptr()), PTR(floats.data_ptr()), I64(len(steps)),
                     PTR(self.arrays[2].data_ptr()), I64(len(offsets)), I64(workspace))  # fmt: skip
        self.run = kernels().qt_chain_run
        self.shape, self.stride, self.dtype = tuple(out.shape), out.stride(), out.dtype
        self.tensors = constants
        self.versions = [t._version for t in constants]
        self.pointers = [t.data_ptr() for t in constants]
        self.keep = keep

    def current(self, constants: tuple[Any, ...]) -> bool:
        """The constants are the tensors the plan was made from (identity), unchanged
        (version counter, data pointer). Each check is one ``map`` over them, run in C: the
        same three checks per constant as a loop, without its bytecode per constant."""
        return (
            len(constants) == len(self.tensors)
            and all(map(operator.is_, constants, self.tensors))
            and list(map(_VERSION, constants)) == self.versions
            and list(map(Tensor.data_ptr, constants)) == self.pointers
        )


def _top_level_refs(args: tuple[Any, ...]) -> tuple[tuple[int, Ref], ...] | None:
    nested = any(isinstance(a, list | tuple) and _has_ref(a) for a in args)
    return None if nested else tuple((i, a) for i, a in enumerate(args) if isinstance(a, Ref))


def _has_ref(arg: Any) -> bool:
    if isinstance(arg, Ref):
        return True
    return isinstance(arg, list | tuple) and any(_has_ref(a) for a in arg)


def _layout(t: Tensor) -> tuple:
    return t.dtype, t.shape, t.stride()


class ChainCall:
    """A chain of nodes as one call ``chain(*inputs, *constants)``: native once planned for
    the inputs' layouts and these constants, else each op in turn (``run_ops``)."""

    def __init__(self, names: list[str], targets: list[Callable[..., Any]],
                 args: list[tuple[Any, ...]], n_inputs: int = 1) -> None:  # fmt: skip
        self.names, self.targets, self.args, self.n_inputs = names, targets, args, n_inputs
        self.__name__ = "chain_" + "_".join(names)
        self.__module__ = __name__
        self.plans: dict[tuple, Plan | None] = {}
        self.refs = [_top_level_refs(a) for a in args]
        """Per step, the positions of the tensors it reads (None: some are inside lists)."""

    def __getstate__(self) -> dict:  # a copy plans its own calls
        return {"names": self.names, "targets": self.targets, "args": self.args,
                "n_inputs": self.n_inputs}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __call__(self, *args: Any) -> Any:
        n = self.n_inputs
        inputs, constants = args[:n], args[n:]
        first = args[0] if args else None
        if n == 1 and type(first) is Tensor:  # the common case, without the generators
            key: tuple | None = ((first.dtype, first.shape, first.stride()),)
        else:
            key = (
                tuple(_layout(t) for t in inputs)
                if all(type(t) is Tensor for t in inputs)
                else None
            )
        if key is not None:
            plan = self.plans.get(key, UNSEEN)
            if plan is not None and plan is not UNSEEN and plan.current(constants):
                out = torch.empty_strided(plan.shape, plan.stride, dtype=plan.dtype)
                pointers = (ctypes.c_void_p * n)(*[t.data_ptr() for t in inputs])
                plan.run(*plan.head, pointers, n, out.data_ptr())
                return out
            # an unseen layout while there is room, or a plan whose constants changed: made
            # anew; a layout found unplannable (None) stays on the ops
            room = plan is not UNSEEN or len(self.plans) < PLANS_KEPT
            if plan is not None and room and all(type(t) is Tensor for t in constants):
                return self.plan(key, inputs, constants)
        return self.run_ops(inputs, constants)[-1]

    def run_ops(self, inputs: tuple[Any, ...], constants: tuple[Any, ...]) -> list[Any]:
        """Each op of the chain in turn, as the per-op forward runs them: every output."""
        outputs: list[Any] = []
        for target, args, refs in zip(self.targets, self.args, self.refs, strict=True):
            if refs is None:  # a tensor inside a list
                outputs.append(target(*_resolve(args, inputs, constants, outputs)))
                continue
            given = list(args)
            for i, ref in refs:
                if ref.constant >= 0:
                    given[i] = constants[ref.constant]
                else:
                    given[i] = inputs[ref.input] if ref.input >= 0 else outputs[ref.step]
            outputs.append(target(*given))
        return outputs

    def plan(self, key: tuple, inputs: tuple[Tensor, ...], constants: tuple[Tensor, ...]) -> Any:
        """Run the ops (each checks its contract), then make the native plan from what they
        did; an input or step the native call does not cover keeps the per-op path."""
        outputs = self.run_ops(inputs, constants)
        try:
            self.plans[key] = make_plan(self, inputs, constants, outputs)
        except Unplanned:
            self.plans[key] = None
        return outputs[-1]


class Unplanned(Exception):
    """A chain step the native call does not cover (it stays on the per-op path)."""


def _channels_last(t: Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)


def make_plan(chain: ChainCall, inputs: tuple[Tensor, ...], constants: tuple[Tensor, ...],
              outputs: list[Tensor]) -> Plan:  # fmt: skip
    """The native steps that compute ``outputs`` (what the ops returned on ``inputs``).

    Buffers: the inputs first (0, 1, ...), then the output, then the workspace's."""
    n_in = len(inputs)
    output = n_in
    sizes: list[int] = [0] * (n_in + 1)
    steps: list[Step] = []
    keep: list[Any] = []
    last = len(outputs) - 1

    def scratch(t: Tensor) -> int:
        sizes.append((t.numel() * t.element_size() + 63) // 64 * 64)
        return len(sizes) - 1

    buffer_of: list[int] = []  # the buffer holding each step's output

    def operand(ref: Any) -> tuple[Tensor, int]:
        if ref.input >= 0:
            return inputs[ref.input], ref.input
        return outputs[ref.step], buffer_of[ref.step]

    for s, (name, target, args) in enumerate(zip(chain.names, chain.targets, chain.args,
                                                 strict=True)):  # fmt: skip
        first = 1 if name == "binary" else 0
        t_in, b_in = operand(args[first])
        t_out = outputs[s]
        if target in VIEWS and t_out.data_ptr() == t_in.data_ptr() and t_out.is_contiguous():
            buffer_of.append(b_in)  # a view of the same bytes (never a chain's last step)
            continue
        b_out = output if s == last else scratch(t_out)
        resolved = _resolve(args, inputs, constants, outputs)
        if target in VIEWS:
            if _channels_last(t_in) and t_out.is_contiguous():
                n, c, h, w = t_in.shape
                steps.append(([TO_CONTIGUOUS, b_in, b_out, n, c, h * w], ()))
                buffer_of.append(b_out)
                continue
            raise Unplanned(name)
        if name == "quantize":
            if t_in.dtype != torch.float32 or not t_in.is_contiguous():
                raise Unplanned(name)
            fields = [QUANTIZE, b_in, b_out, t_in.numel()]
            steps.append((fields, (1.0 / resolved[1], float(resolved[2]))))
        elif name == "dequantize":
            if _channels_last(t_in) and not t_in.is_contiguous():
                n, c, h, w = t_in.shape
                b_mid = scratch(t_in)
                steps.append(([TO_CONTIGUOUS, b_in, b_mid, n, c, h * w], ()))
                b_in = b_mid
            elif not t_in.is_contiguous():
                raise Unplanned(name)
            steps.append(([DEQUANTIZE, b_in, b_out, t_in.numel()],
                          (float(resolved[1]), float(resolved[2]))))  # fmt: skip
        elif name == "lookup":
            if not _dense(t_in) or t_out.stride() != t_in.stride():
                raise Unplanned(name)
            table = resolved[1]
            keep.append(table)
            steps.append(([LOOKUP, b_in, b_out, t_in.numel(), table.data_ptr()], ()))
        elif name == "binary":
            steps.append(_binary_step(resolved, t_in, b_in, operand(args[2]), t_out, b_out))
        elif name in ("conv2d", "max_pool2d"):
            if not _channels_last(t_in):
                if not t_in.is_contiguous() or t_in.dim() != 4:
                    raise Unplanned(name)
                n, c, h, w = t_in.shape
                b_mid = scratch(t_in)
                steps.append(([TO_CHANNELS_LAST, b_in, b_mid, n, c, h * w], ()))
                b_in = b_mid
            if name == "max_pool2d":
                _, kernel, stride, padding, dilation, _ = resolved
                n, c, h, w = t_in.shape
                fields = [MAX_POOL, b_in, b_out, n, c, h, w, *kernel, *stride, *padding,
                          *dilation, t_out.shape[2], t_out.shape[3]]  # fmt: skip
                steps.append((fields, ()))
            else:
                steps.append(_conv_step(target, t_in, b_in, b_out, keep))
        elif name == "linear":
            if not t_in.is_contiguous():
                raise Unplanned(name)
            steps.append(_linear_step(target, t_in, b_in, b_out, keep))
        else:  # pragma: no cover - find_chains admits only the names above
            raise Unplanned(name)
        buffer_of.append(b_out)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size
    return Plan(steps, offsets, at, outputs[-1], constants, tuple(keep))


def _dense(t: Tensor) -> bool:
    return t.is_contiguous() or _channels_last(t)


def _binary_step(resolved: tuple[Any, ...], a: Tensor, b_a: int, other: tuple[Tensor, int],
                 out: Tensor, b_out: int) -> Step:  # fmt: skip
    """``binary`` of two operands of one shape and one dense layout (a residual add of two
    conv outputs), read and written in memory order as the op does; anything else (a
    broadcast, two layouts) is not planned."""
    b, b_b = other
    if a.shape != b.shape or a.stride() != b.stride() or out.stride() != a.stride():
        raise Unplanned("binary")
    if not _dense(a):
        raise Unplanned("binary")
    kind, _, _, sa, za, sb, zb, out_scale, out_zp = resolved
    fields = [BINARY, b_a, b_out, a.numel(), b_b, BINARY_KINDS[kind]]
    return fields, (float(sa), float(za), float(sb), float(zb), 1.0 / out_scale, float(out_zp))


def _binding(target: Any, name: str) -> Any:
    if not isinstance(target, BoundCall) or not target.binding.bound:
        raise Unplanned(name)
    return target.binding


def _pointer(p: int | None) -> int:
    return 0 if p is None else int(p)


def _conv_step(target: Any, t_in: Tensor, b_in: int, b_out: int,
               keep: list[Any]) -> Step:  # fmt: skip
    """The kernel call the bound conv2d node made (its kept plan for this shape)."""
    binding = _binding(target, "conv2d")
    plan = binding.plans.get(t_in.shape)
    if plan is None:
        raise Unplanned("conv2d")
    _, _, fn, head, tail, quantized = plan
    keep.append(binding.keep)
    names = getattr(fn, "__name__", "")
    ints = [_pointer(v) if i >= len(head) - 4 else int(v) for i, v in enumerate(head)]
    inv, zp, relu = tail
    if names == "qt_conv2d_grouped":
        return [CONV, b_in, b_out, *ints, int(quantized), int(relu)], (float(inv), float(zp))
    if names == "qt_conv2d_depthwise":
        fields = [CONV_DEPTHWISE, b_in, b_out, *ints, int(quantized), int(relu)]
        return fields, (float(inv), float(zp))
    raise Unplanned("conv2d")


def _linear_step(target: Any, t_in: Tensor, b_in: int, b_out: int,
                 keep: list[Any]) -> Step:  # fmt: skip
    """The kernel call the bound linear node made (its kept plan for this shape)."""
    binding = _binding(target, "linear")
    plan = binding.plans.get(t_in.shape)
    if plan is None:
        raise Unplanned("linear")
    _, _, _, _, head, tail, quantized = plan
    keep.append(binding.keep)
    ints = [_pointer(v) if i >= 4 else int(v) for i, v in enumerate(head)]
    inv, zp, relu = tail
    return [LINEAR, b_in, b_out, *ints, int(quantized), int(relu)], (float(inv), float(zp))


def chain_of(chain: list[fx.Node]) -> tuple[ChainCall, list[fx.Node]]:
    """The call for ``chain`` and the graph values it reads: its inputs, then constants."""
    inputs: list[fx.Node] = []
    constants: list[fx.Node] = []
    index = {node: s for s, node in enumerate(chain)}

    def ref(n: fx.Node) -> Any:
        if n in index:
            return Ref(step=index[n])
        if n.op == "get_attr":
            if n not in constants:
                constants.append(n)
            return Ref(constant=constants.index(n))
        if n not in inputs:
            inputs.append(n)
        return Ref(input=inputs.index(n))

    names: list[str] = []
    targets: list[Callable[..., Any]] = []
    args: list[tuple[Any, ...]] = []
    for node in chain:
        names.append(op_name(node) or str(node.target).split(".")[1])
        targets.append(node.target)  # type: ignore[arg-type]
        args.append(tuple(_map(a, ref) for a in node.args))
    return ChainCall(names, targets, args, len(inputs)), [*inputs, *constants]


def _map(arg: Any, fn: Callable[[fx.Node], Any]) -> Any:
    if isinstance(arg, fx.Node):
        return fn(arg)
    if isinstance(arg, list | tuple):
        return type(arg)(_map(a, fn) for a in arg)
    return arg


def run_chains_natively(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm``'s ``forward`` (in place) run each chain of its graph as one native call;
    ``gm.graph`` is left as it is. Returns ``gm``."""
    if type(gm).__qualname__.split(".")[-1] != "GraphModuleImpl" or not find_chains(gm.graph):
        return gm  # not fx's per-instance class (its forward is shared), or nothing to fuse
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    values: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, values)
    graph.output(out)  # type: ignore[arg-type]
    for chain in find_chains(graph):
        call, reads = chain_of(chain)
        with graph.inserting_before(chain[-1]):
            fused = graph.call_function(call, tuple(reads))
        fused.meta = dict(chain[-1].meta)
        chain[-1].replace_all_uses_with(fused)
        for node in reversed(chain):
            graph.erase_node(node)
    code = graph.python_code(root_module="self")
    type(gm).forward = _forward_from_src(code.src, code.globals)  # type: ignore[method-assign]
    return gm
