"""Identical constants stored once.

A decoder unrolled by export calls the same layer once per step; folding, quantizing and
packing its weights then make one copy per call site (the seq2seq model's lowered graph held
16 copies of its decoder). ``share_identical`` makes every tensor slot whose contents equal
an earlier one's point at that one tensor: memory holds it once, and ``torch.export.save``
writes one tensor for all the names that alias it.

Only constants nothing writes are merged: a slot read by ``get_attr`` nodes whose users do
not mutate it, or one a module declares read-only (``READ_ONLY_BUFFERS``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
import torch.fx as fx

from quantree.backends.cpu.saved.notes import carry
from quantree.core.graphs import owner_of

READ_ONLY_BUFFERS = "quantree_read_only_buffers"
"""A module class attribute: True when its forward never writes its buffers."""


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` may write the tensor ``node`` reads (an in-place op, or unknown)."""
    if user.op != "call_function":
        return user.op != "output"  # a call_module could do anything with it
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return False  # Python functions (getitem) and DirectCall targets: pure
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            if value is node or (isinstance(value, list | tuple) and node in value):
                return True
    return False


def read_only_slots(root: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str]]:
    """``(module, buffer name)`` of every tensor constant of ``root`` nothing writes."""
    for module in root.modules():
        if getattr(type(module), READ_ONLY_BUFFERS, False):
            for name, value in module._buffers.items():
                if value is not None:
                    yield module, name
        graph = getattr(module, "graph", None)
        if not isinstance(module, fx.GraphModule) or not isinstance(graph, fx.Graph):
            continue
        reads = [n for n in graph.nodes if n.op == "get_attr"]
        written = {str(n.target) for n in reads if any(_writes(u, n) for u in n.users)}
        for target in dict.fromkeys(str(n.target) for n in reads):
            owner, leaf = owner_of(module, target)
            buffers = owner._buffers if isinstance(owner, torch.nn.Module) else {}
            if target not in written and buffers.get(leaf) is not None:
                yield owner, leaf  # type: ignore[misc]


def _key(t: torch.Tensor) -> tuple:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).digest()
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.device, digest)


def share_identical(root: torch.nn.Module) -> int:
    """Point every read-only constant of ``root`` equal to an earlier one at that one.

    Returns the bytes no longer held twice.
    """
    canonical: dict[tuple, torch.Tensor] = {}
    saved = 0
    done: set[tuple[int, str]] = set()
    for owner, name in read_only_slots(root):
        if (id(owner), name) in done:
            continue
        done.add((id(owner), name))
        value = owner._buffers[name]
        if value is None or value.is_sparse or value.device.type == "meta":
            continue
        key = _key(value)
        first = canonical.setdefault(key, value)
        if first is not value and first.untyped_storage().data_ptr() != (
            value.untyped_storage().data_ptr()
        ):
            owner._buffers[name] = first
            carry(first, value)  # what a backend recorded about it holds for its equal
            saved += value.numel() * value.element_size()
    return saved
