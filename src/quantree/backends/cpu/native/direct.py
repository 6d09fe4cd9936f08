"""Calling quantree's ops without the dispatcher, in memory.

A custom op implemented in Python pays the dispatcher on every call: it boxes each argument
and unboxes it again for the Python kernel, which for a convolution's fifteen arguments is
more than a small int8 layer computes. A lowered
graph therefore calls each op's CPU implementation directly through ``DirectCall``; the
graph still reads as the op (``str``, ``==``, ``hash``), and anything that is not a plain
tensor (the fake tensors of ``torch.export`` when the model is saved) goes through the op,
so saved programs hold ``torch.ops.quantree.*`` as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

from quantree.backends.cpu.cells.program import cell_loop
from quantree.backends.cpu.native.bound_calls import BINDINGS, Binding
from quantree.backends.cpu.native.bound_programs import BoundProgram
from quantree.backends.cpu.ops import (
    attention,
    avg_pool2d,
    binary,
    conv1d,
    conv1d_w16,
    conv2d,
    conv16,
    conv_transpose,
    conv_transpose16,
    dequantize,
    embedding_rows,
    glu,
    group_norm,
    linear,
    linear16,
    lookup,
    matmul,
    max_pool2d,
    mean_hw,
    norm_block,
    pad_last,
    program,
    quantize,
    rnn,
    rnn_cell,
    softmax,
)
from quantree.backends.cpu.ops.recurrent.rnn import RnnRunner
from quantree.backends.cpu.ops.recurrent.rnn_packed import PackedRnnRunner

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn
    for fn in (attention, avg_pool2d, binary, cell_loop, conv1d, conv1d_w16, conv2d, conv16,
               conv_transpose, conv_transpose16, dequantize, embedding_rows, glu, group_norm,
               linear, linear16, lookup, matmul, max_pool2d, mean_hw, norm_block, pad_last,
               program, quantize, rnn, rnn_cell, softmax)
}  # fmt: skip
"""Each ``torch.ops.quantree.<name>``'s CPU implementation, by name (read only)."""
PER_NODE: dict[str, Callable[[], Callable[..., Any]]] = {
    "rnn": RnnRunner,
    "rnn_packed_sequence": PackedRnnRunner,
}
"""Ops whose implementation keeps state for one graph node (an argument block built at its
first call): a fresh implementation per node, made by the factory."""


class DirectCall:
    """``op`` as a graph target that calls its implementation straight for plain tensors.

    ``node_args`` (the node's ``args``, when known) says where tensors can be: only an
    argument that is a graph value (or a list of them) can hold one, the rest are constants
    the graph spells out. Checking just those positions is several times cheaper than
    scanning every argument, on every call.
    """

    def __init__(
        self,
        op: OpOverload,
        implementation: Callable[..., Any],
        node_args: tuple[Any, ...] | None = None,
    ) -> None:
        self.op = op
        self.implementation = implementation
        self.namespace = op.namespace
        self.__name__ = op.__name__.replace(".", "_")
        self.__module__ = __name__
        self.arity, self.values, self.lists = _value_positions(node_args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != self.arity:  # not the node it was made for: look at everything
            plain = all(type(t) is torch.Tensor for t in _tensors(args))
        else:
            plain = _plain(args, self.values, self.lists)
        if plain:
            return self.implementation(*args, **kwargs)
        return self.op(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        """Equal to its op; to another ``DirectCall`` only if they share their state too.

        fx's code generator names a target once per equal object, so two nodes whose calls
        compared equal would both call the first one's (a per-node runner or binding would
        then serve both nodes, re-preparing on every call)."""
        if isinstance(other, DirectCall):
            return other.op == self.op and other.state() is self.state()
        return other == self.op

    def __hash__(self) -> int:
        return hash(self.op)

    def state(self) -> object:
        """What a call keeps between calls: the implementation (a per-node one for ``rnn``)."""
        return self.implementation

    def __str__(self) -> str:
        return str(self.op)

    def __repr__(self) -> str:
        return f"DirectCall({self.op})"


class BoundCall(DirectCall):
    """A ``DirectCall`` whose op checks its contract once per node and then only what can
    change between calls (``bound_calls.py``): its pre-checked fast entry."""

    def __init__(
        self,
        op: OpOverload,
        implementation: Callable[..., Any],
        node_args: tuple[Any, ...] | None,
        binding: Callable[[Callable[..., Any]], Binding | BoundProgram],
    ) -> None:
        super().__init__(op, implementation, node_args)
        self.binding = binding(op)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or (len(args) != self.arity and self.arity >= 0):  # not its node's call
            return super().__call__(*args, **kwargs)
        return self.binding.fast(args)

    def state(self) -> object:
        return self.binding


def _value_positions(
    node_args: tuple[Any, ...] | None,
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(number of arguments, positions of graph values, positions of lists holding any)."""
    if node_args is None:
        return -1, (), ()
    values = tuple(i for i, a in enumerate(node_args) if isinstance(a, fx.Node))
    lists = tuple(
        i
        for i, a in enumerate(node_args)
        if isinstance(a, list | tuple) and any(isinstance(v, fx.Node) for v in a)
    )
    return len(node_args), values, lists


def _plain(args: tuple[Any, ...], values: tuple[int, ...], lists: tuple[int, ...]) -> bool:
    """No tensor at those positions is a subclass (a fake tensor while exporting)."""
    tensor = torch.Tensor
    for i in values:
        a = args[i]
        if type(a) is not tensor and isinstance(a, tensor):
            return False
    for i in lists:
        for a in args[i]:
            if type(a) is not tensor and isinstance(a, tensor):
                return False
    return True


def _tensors(args: tuple[Any, ...]) -> list[Any]:
    found: list[Any] = []
    for a in args:
        if isinstance(a, list | tuple):
            found += [t for t in a if isinstance(t, torch.Tensor)]
        elif isinstance(a, torch.Tensor):
            found.append(a)
    return found


def call_directly(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm``'s quantree ops ``DirectCall`` targets (in place); returns ``gm``."""
    changed = False
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, OpOverload) and target.namespace == "quantree":
            name = target._schema.name.split("::")[1]
            factory = PER_NODE.get(name)
            implementation = factory() if factory else IMPLEMENTATIONS.get(name)
            binding: Any = BoundProgram if name == "program" else BINDINGS.get(name)
            if binding is not None and implementation is not None:
                node.target = BoundCall(target, implementation, node.args, binding)
                changed = True
            elif implementation is not None:
                node.target = DirectCall(target, implementation, node.args)
                changed = True
    if changed:
        gm.recompile()
    return gm
