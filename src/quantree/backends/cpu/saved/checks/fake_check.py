"""A loaded graph run once on fake tensors shaped like its saved example, before any call.

Every node of a file's graph may be well named and still not fit its arguments: a
positional argument moved to a keyword, an index past a dimension, a shape that no longer
matches the tensor it views. The first real call would raise whatever the op raises (a raw
``RuntimeError``, an ``IndexError``) far from the file that caused it. Propagating fake
tensors (shapes and dtypes only, nothing allocated, no kernel run) through the graph at
load finds those nodes while the file is being read, naming the node; it costs a few
milliseconds per hundred nodes. Past a node whose output shape depends on tensor values (a
packed sequence's batch sizes) fake tensors cannot follow: the graph is checked up to it.
The native ops' own contracts (``native_checks``, ``program_checks``) still run at each
call: their fake kernels check shapes only.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_leaves, tree_map_only

from quantree.core.errors import QuantreeError


def _cell_widths(op: Any, args: tuple[Any, ...]) -> str | None:
    """A cell loop's input and state widths against its slot table's (the real table: a
    fake kernel cannot read it), as the op checks them at a call."""
    packed = op == torch.ops.quantree.cell_loop_packed.default
    xs, state, slots = (args[0], args[2], args[6]) if packed else (args[0], args[1], args[5])
    if not isinstance(slots, torch.Tensor) or isinstance(slots, FakeTensor):
        return None
    if slots.dim() != 2 or slots.shape[1] < 4 or slots.shape[0] < 1 + len(state):
        return None  # program_checks refuses the table
    widths = [int(w) for w in slots[: 1 + len(state), 3]]
    got = [xs.shape[-1], *(s.shape[-1] for s in state)]
    batch = [] if packed else [xs.shape[1], *(s.shape[0] for s in state)]
    if got != widths or len(set(batch)) > 1 or any(s.dim() != 2 for s in state):
        return f"inputs and states of widths {got} for a table of widths {widths}"
    return None


_TABLE_CHECKS: dict[object, Any] = {
    torch.ops.quantree.cell_loop.default: _cell_widths,
    torch.ops.quantree.cell_loop_packed.default: _cell_widths,
}
"""Checks of a native op's arguments against its real tables, beside its fake kernel."""


_DATA_DEPENDENT = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)


class _Unknowable(Exception):
    """A node's output shape depends on tensor values (a packed sequence's batch sizes):
    fake tensors cannot follow the graph past it."""


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in a fake result (a symbolic size counts as 0: not known)."""
    total = 0
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            numel = t.numel()
            total += numel * t.element_size() if isinstance(numel, int) else 0
    return total


class _Run(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, most_bytes: int | None) -> None:
        super().__init__(module)
        self.most_bytes = most_bytes

    def run_node(self, n: fx.Node) -> Any:
        check = _TABLE_CHECKS.get(n.target) if n.op == "call_function" else None
        if check is not None:
            args, _ = self.fetch_args_kwargs_from_env(n)
            with unset_fake_temporarily():
                try:
                    wrong = check(n.target, args)
                except Exception as error:  # arguments of the wrong kinds or ranks
                    wrong = f"arguments it cannot take ({type(error).__name__}: {error})"
            if wrong is not None:
                raise QuantreeError(f"node {n.name} ({n.target}) reads {wrong}")
        try:
            result = super().run_node(n)
        except QuantreeError:
            raise
        except _DATA_DEPENDENT:
            raise _Unknowable from None
        except Exception as error:
            text = str(error).strip().splitlines()
            raise QuantreeError(
                f"node {n.name} ({n.target}) does not run on the saved example's shapes: "
                f"{type(error).__name__}: {text[0][:200] if text else ''}"
            ) from None
        made = _nbytes(result) if n.op == "call_function" else 0
        if self.most_bytes is not None and made > self.most_bytes:
            raise QuantreeError(
                f"node {n.name} ({n.target}) makes {made} bytes at the saved example's shapes, "
                f"more than the whole load budget ({self.most_bytes} bytes)"
            )
        return result


def check_on_example(module: fx.GraphModule, example: Any, most_bytes: int | None = None) -> None:
    """Run ``module`` on fake tensors like ``example`` (``(args, kwargs)`` as
    ``ExportedProgram.example_inputs`` holds it); a ``QuantreeError`` naming the first node
    that does not run, or that makes more than ``most_bytes`` (the load budget: one
    intermediate tensor of an honest model at its example's size is far smaller)."""
    _kinds_agree(module)
    if example is None:
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = tree_leaves(tree_map_only(torch.Tensor, mode.from_tensor, example))
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders):
        raise QuantreeError(
            f"the saved example has {len(flat)} inputs, the graph {len(placeholders)}"
        )
    with mode, contextlib.suppress(_Unknowable):  # checked up to the first such node
        _Run(module, most_bytes).run(*flat)


def _is_tensor_type(kind: Any) -> bool:
    """A tensor or an optional tensor (not a list of them)."""
    if isinstance(kind, torch._C.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch._C.TensorType)


def _returned(node: fx.Node) -> Any:
    """The schema type of what ``node`` gives (None where the schema does not say)."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        source = node.args[0]
        if isinstance(source.target, torch._ops.OpOverload) and isinstance(node.args[1], int):
            returns = source.target._schema.returns
            if len(returns) == 1 and isinstance(returns[0].type, torch._C.ListType):
                return returns[0].type.getElementType()  # one item of a list (split, unbind)
            return returns[node.args[1]].type if node.args[1] < len(returns) else None
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return returns[0].type if len(returns) == 1 else None
    return None


def _number(kind: Any) -> bool:
    return isinstance(
        kind,
        torch._C.IntType | torch._C.FloatType | torch._C.BoolType | torch._C.NumberType
        | torch._C.SymIntType | torch._C.SymBoolType,
    )  # fmt: skip


def _numbers_wrapped(op: torch._ops.OpOverload) -> bool:
    """aten's own list of ops whose tensor arguments take a Python number (``add``, ``sub``,
    ``mul``, ``div``...: the number becomes a 0-d tensor); others (``relu``) refuse one."""
    name = op._schema.name
    return name.startswith("aten::") and torch._C._should_allow_numbers_as_tensors(name[6:])


def _kinds_agree(module: fx.GraphModule) -> None:
    """Every argument a schema types as a tensor reads a node that gives a tensor, and the
    other way round: a swapped op (``item`` where ``select`` was) is refused at load, not
    left to fail inside a kernel at call. The fake run cannot tell: it stops at the first
    data-dependent node."""
    for node in module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        given = list(zip(schema.arguments, node.args, strict=False))
        given += [(a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs]
        for argument, value in given:
            if not isinstance(value, fx.Node):
                continue
            produced = _returned(value)
            if produced is None:
                continue
            wants = _is_tensor_type(argument.type)
            gives = _is_tensor_type(produced)
            if wants and not gives and _number(produced) and _numbers_wrapped(node.target):
                continue  # torch.export's ``sub.Tensor(t, sym_size)``: aten wraps the number
            if wants != gives:
                raise QuantreeError(
                    f"node {node.name} ({node.target}) takes {argument.name} as "
                    f"{argument.type}, but node {value.name} ({value.target}) gives {produced}"
                )
