"""Values and Uses: the addressing that makes nested structures ordinary.

A Value is one tensor leaf of a node's output, ``(node, path)``; a Use is one tensor input of
a node, ``(value, user, arg_path)``. Paths are tuples of ints (sequence positions) and strs
(mapping keys / keyword names), the pytree key path with the key classes stripped, so they
print and compare simply.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from quantree.core.errors import QuantreeError

Path = tuple[int | str, ...]


def _key_to_part(key: Any) -> int | str:
    if isinstance(key, pytree.SequenceKey):
        return key.idx
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key)


def leaves_with_paths(obj: Any, is_leaf: Any = None) -> list[tuple[Path, Any]]:
    """Every leaf of a nested structure with its path (tuples and lists alike)."""
    flat, _ = pytree.tree_flatten_with_path(obj, is_leaf=is_leaf)
    return [(tuple(_key_to_part(k) for k in path), leaf) for path, leaf in flat]


def get_at(obj: Any, path: Path) -> Any:
    for part in path:
        obj = obj[part]
    return obj


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def tensor_meta(node: fx.Node) -> Any:
    return node.meta.get("val")


QUANTIZABLE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
"""The float dtypes the reference graph's q/dq ops read (pt2e's ``quantized_decomposed``
ops compute in float32 and refuse float64). A float64 tensor is not a quantization point: a
model computes one on purpose (a rotary table, positions), and its q op would raise."""


def is_float_tensor(meta: Any) -> bool:
    """A tensor quantree may quantize: float32, bfloat16 or float16."""
    return isinstance(meta, torch.Tensor) and meta.dtype in QUANTIZABLE_FLOATS


@dataclass(frozen=True)
class Value:
    """One tensor leaf of a node's output."""

    node: fx.Node
    path: Path = ()

    @staticmethod
    def of(node: fx.Node, path: Path = ()) -> Value:
        """The canonical Value: a ``getitem`` chain resolves to its tuple-valued root."""
        while is_getitem(node) and isinstance(node.args[1], int | str):
            parent = node.args[0]
            assert isinstance(parent, fx.Node)
            path = (node.args[1], *path)
            node = parent
        return Value(node, path)

    @property
    def meta(self) -> Any:
        return get_at(tensor_meta(self.node), self.path)

    def __str__(self) -> str:
        suffix = "".join(f"[{p!r}]" for p in self.path)
        return f"{self.node.name}{suffix}"


@dataclass(frozen=True)
class Use:
    """One tensor input edge: ``value`` read by ``user`` at ``arg_path`` of its arguments.

    ``arg_path`` starts with the positional index (int) or keyword name (str).
    """

    value: Value
    user: fx.Node
    arg_path: Path

    @staticmethod
    def of(user: fx.Node, arg_path: Path) -> Use:
        """The Use at ``arg_path``; paths come from annotations, so a wrong one names the node."""
        try:
            arg = arg_at(user, arg_path)
        except (IndexError, KeyError, TypeError, ValueError) as error:
            raise QuantreeError(
                f"node {user.name} ({user.target}) has no argument at path {list(arg_path)}: "
                f"its args are {_describe(user.args)} and its kwargs {_describe(user.kwargs)}; "
                "give a path that exists, e.g. (0,) for the first argument or (1, 0) for the "
                "first tensor of a list in the second"
            ) from error
        if not isinstance(arg, fx.Node):
            raise QuantreeError(
                f"node {user.name} ({user.target}): argument {list(arg_path)} is not a tensor "
                "produced by another node; annotate only tensor inputs"
            )
        return Use(Value.of(arg), user, arg_path)

    def __str__(self) -> str:
        return f"{self.user.name}.input{list(self.arg_path)}"


def arg_at(node: fx.Node, arg_path: Path) -> Any:
    head, *rest = arg_path
    root = node.kwargs[head] if isinstance(head, str) else node.args[head]
    return get_at(root, tuple(rest))


def _describe(args: Any) -> str:
    """Arguments with nodes shown by name, for error messages."""
    return str(pytree.tree_map_only(fx.Node, lambda n: n.name, args))


def output_values(node: fx.Node) -> list[Value]:
    """The Values of a node: one per tensor leaf of ``meta['val']``."""
    meta = tensor_meta(node)
    return [
        Value(node, path)
        for path, leaf in leaves_with_paths(meta)
        if isinstance(leaf, torch.Tensor)
    ]


def input_uses(node: fx.Node) -> Iterator[Use]:
    """Every tensor input of ``node`` with its path inside (possibly nested) args."""
    if is_getitem(node):
        return
    for head, root in [*enumerate(node.args), *node.kwargs.items()]:
        for path, leaf in leaves_with_paths(root):
            if isinstance(leaf, fx.Node) and isinstance(tensor_meta(leaf), torch.Tensor):
                arg_path: Path = (head, *path)  # type: ignore[arg-type]
                yield Use(Value.of(leaf), node, arg_path)


def value_carriers(graph: fx.Graph) -> dict[Value, fx.Node]:
    """The node that holds each Value's tensor: the node itself or its getitem leaf."""
    carriers: dict[Value, fx.Node] = {}
    for node in graph.nodes:
        if isinstance(tensor_meta(node), torch.Tensor):
            carriers.setdefault(Value.of(node), node)
    return carriers


def module_scope(node: fx.Node) -> str:
    """The fully qualified name of the innermost module that produced ``node`` ('' at top)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return str(path).replace("L['self'].", "").replace("L__self___", "")


Key = Value | Use
"""What quantization specs attach to and sharing groups are made of."""


def value_of(key: Key) -> Value:
    """The Value a key holds: itself, or the Value a Use reads."""
    return key if isinstance(key, Value) else key.value


def node_of(key: Key) -> fx.Node:
    """The node an error about ``key`` names: the producer of a Value, the user of a Use."""
    return key.node if isinstance(key, Value) else key.user
