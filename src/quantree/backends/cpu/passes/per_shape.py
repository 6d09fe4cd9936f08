"""Arithmetic on input shapes and constants, run once per input shape instead of every call.

A model that computes its padding from its input's length (Hugging Face's Encodec:
``_get_extra_padding_for_conv1d`` / ``_pad1d`` in every convolution) is captured by
``torch.export`` with that length symbolic, so the graph spells the arithmetic out: 0-d
integer tensor ops on the convolution's ``stride`` / ``kernel_size`` buffers, ``item``,
Python ``+`` / ``>=`` on ``SymInt``s and an ``_assert_scalar`` for every fact export
assumed about the unbacked integers. Lowered, each is a call of a few microseconds on every
forward, and there are hundreds of them around a few dozen layers; their results depend on
nothing a call can change but the input's shape.

``compute_once_per_shape`` finds every node whose value is determined by the sizes of graph
inputs (``sym_size``), constant tensors nothing in the graph writes, Python scalars and
other such nodes, and replaces them all with one call (``PerShape``) returning the values
the rest of the graph reads. The first call for an input shape runs the original nodes on
the real values (its asserts included: a shape that violates one raises, every time, and
nothing is kept); later calls with that shape return what it computed. What the verdict
rests on, checked per call: the shapes of the inputs read (the whole shape, a finer key
than the sizes read), the values of scalar inputs, and each constant being the tensor
evaluated, unchanged (identity, version counter, data pointer, as ``native/bound_calls.py``).

Values handed to the caller or to an op that writes its input stay computed per call (a
cached tensor must not be seen or changed by anyone). Tensors kept are small (at most
``MAX_ELEMENTS``, known from the capture's shapes, or, where the shape follows a symbolic
input length, checked when computed: ``KEPT_ELEMENTS``), and at most ``SHAPES_KEPT`` shapes.

The rewrite is a runtime form, like ``native/direct.py``'s targets: ``save`` exports through
``PerShape``, which runs the original nodes on ``torch.export``'s fake tensors, so a saved
program holds the original ops (its vocabulary unchanged), and ``load`` applies this again.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

aten = torch.ops.aten

MAX_ELEMENTS = 1024
"""A kept tensor's size bound: shape arithmetic is 0-d; an index table of a few hundred."""
SIZED_ELEMENTS = 1 << 14
"""The same bound for a tensor whose shape follows the input's (a symbolic length): Griffin's
position ids, rotary tables, reset mask and local-attention mask, 4096 values at 64 tokens."""
KEPT_ELEMENTS = 1 << 18
"""What such a tensor may hold at run time and still be kept (512 tokens' attention mask);
a longer input evaluates the nodes on every call, as without this pass."""
SHAPES_KEPT = 16
"""Input shapes whose values are kept (the oldest is dropped first)."""
MIN_NODES = 4
"""Fewer calls than this are cheaper run than looked up."""

SIZES: frozenset[object] = frozenset({aten.sym_size.int, aten.sym_numel.default})
"""Reads of an input's shape (not its strides: the key is the shape)."""
_SCALAR_FUNCTIONS: tuple[str, ...] = (
    "sym_not", "sym_ite", "sym_max", "sym_min", "sym_float", "sym_int", "sym_sqrt", "sym_sum",
)  # fmt: skip
_OPERATORS: tuple[str, ...] = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "getitem",
)  # fmt: skip
PYTHON_FUNCTIONS: frozenset[object] = frozenset(
    [getattr(torch, name) for name in _SCALAR_FUNCTIONS if hasattr(torch, name)]
    + [math.ceil, math.floor, math.trunc, math.sqrt]
    + [getattr(operator, name) for name in _OPERATORS]
)
"""Python-level functions ``torch.export`` writes for ``SymInt`` / ``SymBool`` arithmetic."""


def _pure_aten(target: object) -> bool:
    """An aten op that writes no memory, draws no random numbers and fills what it returns
    (an ``empty`` would be kept with whatever memory held)."""
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not target.__name__.startswith(("empty", "new_empty"))


def _small(value: object) -> bool:
    """Not a tensor, or one whose captured shape is fixed and at most ``MAX_ELEMENTS``, or
    symbolic and at most ``SIZED_ELEMENTS`` at the capture's sizes (``PerShape`` then keeps it
    only while it stays under ``KEPT_ELEMENTS``)."""
    tensors = [v for v in _leaves(value) if isinstance(v, torch.Tensor)]
    return all(_hint_numel(t) <= MAX_ELEMENTS if all(isinstance(d, int) for d in t.shape)
               else _hint_numel(t) <= SIZED_ELEMENTS for t in tensors)  # fmt: skip


def _hint_numel(t: torch.Tensor) -> float:
    """``t``'s element count at the capture's sizes (infinite where a size has no hint)."""
    total = 1
    for d in t.shape:
        hint = d if isinstance(d, int) else getattr(d.node, "hint", None)
        if not isinstance(hint, int):
            return math.inf
        total *= hint
    return total


def _keepable(values: tuple[Any, ...]) -> bool:
    return all(t.numel() <= KEPT_ELEMENTS for t in _leaves(values) if isinstance(t, torch.Tensor))


def _leaves(value: object) -> list[object]:
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` may write one of its inputs (a mutable aten op, or anything not a
    known pure function: a module call, a higher-order op)."""
    target = node.target
    if node.op == "output":
        return True  # handed to the caller, who may write to it
    if isinstance(target, OpOverload):
        return target._schema.is_mutable
    return node.op != "call_function" or (target not in PYTHON_FUNCTIONS and not _native(node))


def _native(node: fx.Node) -> bool:
    """quantree's lowered ops read their arguments and write only what they return."""
    return str(node.target).startswith("quantree.")


def _constant(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A ``get_attr`` of a tensor that no node of the graph writes."""
    if node.op != "get_attr":
        return False
    owner: Any = gm
    for part in str(node.target).split("."):
        owner = getattr(owner, part, None)
    return isinstance(owner, torch.Tensor) and not any(_writes(u) for u in node.users)


SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _scalar_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and isinstance(node.meta.get("val"), SCALARS)


def _sized_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)


def shape_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes whose values only the input shapes and constants determine, in graph order:
    sizes of tensor inputs, and pure calls reading only those, constants, scalar inputs and
    each other. A tensor value read by the caller or by an op that may write it is left out
    (so is everything computed from it)."""
    members: set[fx.Node] = set()
    ordered: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        reads = node.all_input_nodes
        if node.target in SIZES:
            ok = len(reads) == 1 and _sized_input(reads[0])
        elif node.target in PYTHON_FUNCTIONS or _pure_aten(node.target):
            ok = all(
                r in members or _constant(r, gm) or _scalar_input(r) for r in reads
            ) and _small(node.meta.get("val"))
        else:
            ok = False
        if ok and isinstance(node.meta.get("val"), torch.Tensor):
            ok = not any(_writes(u) for u in node.users)
        if ok:
            members.add(node)
            ordered.append(node)
    return ordered


class PerShape:
    """The shape-determined nodes of one graph as a call whose values are kept per shape.

    Called with the tensor inputs whose sizes the nodes read, then the scalar inputs, then
    the constants (``counts``: how many of the first two kinds); returns the values of the
    nodes the rest of the graph reads, as a tuple.
    """

    def __init__(self, body: fx.GraphModule, sized: int, scalars: int) -> None:
        self.body = body
        self.sized = sized
        self.keyed = sized + scalars
        self.kept: dict[tuple[Any, ...], tuple[tuple[Any, ...], tuple[Any, ...], Any]] = {}
        self.evaluations = 0  # full runs of the nodes (tests read it)
        self.__name__ = "per_shape"
        self.__module__ = __name__

    def __call__(self, *args: Any) -> Any:
        sized = args[: self.sized]
        if not all(type(t) is torch.Tensor for t in sized):
            return self.body(*args)  # torch.export's fake tensors: the nodes themselves
        key = tuple(t.shape for t in sized) + args[self.sized : self.keyed]
        constants = args[self.keyed :]
        entry = self.kept.get(key)
        if entry is not None:
            checked, stamps, values = entry
            if all(map(operator.is_, constants, checked)) and _stamps(constants) == stamps:
                return values
        if not all(type(t) is torch.Tensor for t in constants):
            return self.body(*args)
        values = self.body(*args)  # asserts raise here, and nothing is kept
        self.evaluations += 1
        if not _keepable(values):
            return values
        if key not in self.kept and len(self.kept) >= SHAPES_KEPT:
            del self.kept[next(iter(self.kept))]
        self.kept[key] = (constants, _stamps(constants), values)
        return values

    def __getstate__(self) -> dict[str, Any]:  # a copy evaluates with its own constants
        return {**self.__dict__, "kept": {}}

    def __str__(self) -> str:
        return "per_shape"

    def __repr__(self) -> str:
        return f"PerShape({len(self.body.graph.nodes)} nodes)"


def _stamps(constants: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((t._version, t.data_ptr()) for t in constants)


def compute_once_per_shape(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``gm``'s shape-determined nodes (``shape_nodes``) by one ``PerShape`` call
    (in place) where there are at least ``MIN_NODES`` of them; returns ``gm``."""
    graph = gm.graph
    members = shape_nodes(gm)
    calls = [n for n in members if n.target not in SIZES]
    if len(calls) < MIN_NODES:
        return gm
    inside = set(members)
    reads: dict[fx.Node, None] = {}
    for node in members:
        reads.update((r, None) for r in node.all_input_nodes if r not in inside)
    sized = [r for r in reads if _sized_input(r)]
    scalars = [r for r in reads if _scalar_input(r)]
    constants = [r for r in reads if r.op == "get_attr"]
    inputs = sized + scalars + constants
    outputs = [n for n in members if any(u not in inside for u in n.users)]

    body_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for r in inputs:
        env[r] = body_graph.placeholder(r.name)
        env[r].meta = dict(r.meta)
    for node in members:
        env[node] = body_graph.node_copy(node, env.__getitem__)
    body_graph.output(tuple(env[n] for n in outputs))
    body = fx.GraphModule(torch.nn.Module(), body_graph, class_name="ShapeArithmetic")
    call = PerShape(body, len(sized), len(scalars))

    first = members[0]
    for r in constants:  # (get_attr reads nothing: moving it earlier is always right)
        if _after(r, first):
            first.prepend(r)
    with graph.inserting_before(first):
        node = graph.call_function(call, tuple(inputs))
        node.meta["val"] = tuple(n.meta.get("val") for n in outputs)
        for i, out in enumerate(outputs):
            value = graph.call_function(operator.getitem, (node, i))
            value.meta = dict(out.meta)
            out.replace_all_uses_with(value, delete_user_cb=lambda u: u not in inside)
    guard = _guards(graph)
    if guard is not None and _after(guard, node):
        node.prepend(guard)  # the capture's own shape checks speak first, as before
    for member in reversed(members):
        graph.erase_node(member)
    graph.lint()
    gm.recompile()
    return gm


def _after(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` comes after ``b`` in their graph."""
    node = b.next
    while node.op != "root":
        if node is a:
            return True
        node = node.next
    return False


def _guards(graph: fx.Graph) -> fx.Node | None:
    """The capture's shape guard call (``_guards_fn``), which reads only graph inputs."""
    found: Callable[[fx.Node], bool] = lambda n: n.target == "_guards_fn"  # noqa: E731
    return next((n for n in graph.find_nodes(op="call_module") if found(n)), None)
