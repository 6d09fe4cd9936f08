"""input_trees: the structure of what a user passes, as torch.export and calibration see it.

Inputs come as pytrees: tuples, lists, dicts, namedtuples and dataclasses of tensors and
python values. torch.export takes any of them once their type is a pytree node, and a
``dynamic_shapes`` spec must mirror them node for node (a namedtuple input needs a
namedtuple of specs, not a tuple; a dataclass the list of its fields' specs). The spec is
built from pytree's own flatten/unflatten of each node, so no container is special-cased.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import (
    BUILTIN_TYPES,
    SUPPORTED_NODES,
    KeyPath,
    TreeSpec,
    _get_node_type,
    keystr,
    tree_flatten_with_path,
)

from quantree.core.errors import QuantreeError

BATCH = {0: torch.export.Dim.AUTO}


def batch_spec(tree: Any, every_dim: bool = False) -> Any:
    """``dynamic_shapes`` for one input: ``{0: Dim.AUTO}`` at every tensor of one or more
    dimensions (every dimension ``Dim.AUTO`` with ``every_dim``), None elsewhere.

    Built-in containers (tuple, list, dict, namedtuple) are mirrored by their own type; a
    registered user type (a dataclass) by the list of its children, which is how
    torch.export (2.13) matches it (a dataclass of specs is refused).
    """
    if isinstance(tree, torch.Tensor):
        if tree.dim() == 0:
            return None
        return {d: torch.export.Dim.AUTO for d in range(tree.dim())} if every_dim else dict(BATCH)
    kind = _get_node_type(tree)
    if kind not in SUPPORTED_NODES:
        return None
    children, context = SUPPORTED_NODES[kind].flatten_fn(tree)
    specs = [batch_spec(child, every_dim) for child in children]
    if kind in BUILTIN_TYPES:
        return SUPPORTED_NODES[kind].unflatten_fn(specs, context)
    return specs


def _containers(tree: Any) -> Iterator[Any]:
    """Every container in ``tree``, including dataclass instances pytree does not know yet
    (which it would otherwise treat as leaves)."""
    if isinstance(tree, torch.Tensor):
        return
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        yield tree
        for field in dataclasses.fields(tree):
            yield from _containers(getattr(tree, field.name))
        return
    if type(tree) in SUPPORTED_NODES:
        yield tree
        children, _ = SUPPORTED_NODES[type(tree)].flatten_fn(tree)
        for child in children:
            yield from _containers(child)


def register_dataclasses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[type]:
    """Register each dataclass type found in the inputs with ``torch.export.register_dataclass``;
    returns the types registered now.

    torch.export refuses a dataclass input until its type is a pytree node, and the captured
    program needs that registration again whenever it is called with one, so it is made
    once per type for the process (as torch's own error asks the user to do). A dataclass
    whose fields are not all constructor arguments cannot be rebuilt from its leaves: that
    is a QuantreeError naming the type.
    """
    registered: list[type] = []
    for node in _containers((args, kwargs)):
        kind = type(node)
        if not dataclasses.is_dataclass(node) or kind in SUPPORTED_NODES:
            continue
        if any(not f.init for f in dataclasses.fields(node)):
            raise QuantreeError(
                f"input of type {kind.__name__} is a dataclass with fields that are not "
                "constructor arguments, which torch.export cannot rebuild; pass its tensors "
                "as a dict or a NamedTuple, or register it with "
                "torch.utils._pytree.register_pytree_node"
            )
        torch.export.register_dataclass(kind)
        registered.append(kind)
    return registered


def leaf_paths(tree: Any) -> list[tuple[KeyPath, Any]]:
    """Every leaf of ``tree`` with its key path."""
    return list(tree_flatten_with_path(tree)[0])


def describe_path(path: KeyPath, names: list[str] | None = None) -> str:
    """A leaf of ``(args, kwargs)`` as the user wrote it: ``inputs['mask']`` (``names`` gives
    positional arguments their parameter names; without, ``argument 0['mask']``), a
    keyword by its name."""
    if not path:
        return "the inputs"
    head, rest = path[0], path[1:]
    index = getattr(head, "idx", None)
    if index == 0 and rest:
        where = getattr(rest[0], "idx", None)
        if names is not None and isinstance(where, int) and where < len(names):
            return f"{names[where]}{keystr(rest[1:])}"
        return f"argument {where}{keystr(rest[1:])}"
    if index == 1 and rest:
        return f"{getattr(rest[0], 'key', rest[0])}{keystr(rest[1:])}"
    return keystr(path)


def structure_difference(
    want: TreeSpec, got: TreeSpec, names: list[str] | None = None, path: KeyPath = ()
) -> str | None:
    """Where ``got`` (a batch's tree) first differs from ``want`` (the captured example's),
    as text naming the path, or None when they have the same structure."""
    from torch.utils._pytree import MappingKey

    if want.is_leaf():
        return None
    if got.is_leaf():
        return f"{describe_path(path, names)} is a single value, the program takes a {_kind(want)}"
    if want.type is not got.type:
        return f"{describe_path(path, names)} is a {_kind(got)}, the program takes a {_kind(want)}"
    if want.type is dict:
        missing = [k for k in want.context if k not in got.context]
        extra = [k for k in got.context if k not in want.context]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"lacks key(s) {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"has key(s) {', '.join(map(repr, extra))} the example did not")
            return f"{describe_path(path, names)} {' and '.join(parts)}"
        by_key = dict(zip(got.context, got.children(), strict=True))
        for key, child in zip(want.context, want.children(), strict=True):
            found = structure_difference(child, by_key[key], names, (*path, MappingKey(key)))
            if found:
                return found
        return None
    if want.num_children != got.num_children or want.context != got.context:
        return (
            f"{describe_path(path, names)} is a {_kind(got)} of {got.num_children} items, the "
            f"program takes a {_kind(want)} of {want.num_children}"
        )
    for key, a, b in zip(_child_keys(want), want.children(), got.children(), strict=True):
        found = structure_difference(a, b, names, (*path, key))
        if found:
            return found
    return None


def _child_keys(spec: TreeSpec) -> list[Any]:
    """The keys pytree gives ``spec``'s children (``.x`` for a namedtuple's field), or
    their positions where its type has no keyed flatten."""
    from torch.utils._pytree import SequenceKey, tree_unflatten

    dummy = tree_unflatten([0] * spec.num_leaves, spec)
    node = SUPPORTED_NODES.get(_get_node_type(dummy))
    if node is not None and node.flatten_with_keys_fn is not None:
        return [key for key, _ in node.flatten_with_keys_fn(dummy)[0]]
    return [SequenceKey(i) for i in range(spec.num_children)]


def _kind(spec: TreeSpec) -> str:
    if spec.type is type(None):
        return "None"
    return getattr(spec.type, "__name__", str(spec.type))
