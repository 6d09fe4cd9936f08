"""Make every tensor leaf of a tuple-valued node an explicit ``getitem`` chain.

After this pass a q/dq pair can sit on any leaf: each leaf has a node of its own, and any
consumer of a whole tuple (a returned ``(h, c)``, a helper taking the pair, a second layer)
reads the leaves re-packed into the same structure instead of the tuple node itself.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from quantree.core.values import is_getitem, tensor_meta


def _leaf_getitems(graph: fx.Graph, node: fx.Node) -> dict[int, fx.Node]:
    """The getitem child of ``node`` for every index of its tuple/list value."""
    children = {
        int(user.args[1]): user  # type: ignore[call-overload]
        for user in node.users
        if is_getitem(user) and isinstance(user.args[1], int)
    }
    meta = tensor_meta(node)
    last = node
    for child in children.values():
        last = child if _after(child, last) else last
    for index, leaf_meta in enumerate(meta):
        if index in children or not _holds_tensor(leaf_meta):
            continue
        with graph.inserting_after(last):
            child = graph.call_function(operator.getitem, (node, index))
        child.meta = {**node.meta, "val": leaf_meta}
        children[index] = child
        last = child
    for index, child in children.items():
        if isinstance(meta[index], tuple | list):
            _leaf_getitems(graph, child)
    return children


def _after(a: fx.Node, b: fx.Node) -> bool:
    return b < a  # fx.Node ordering follows the graph's topological order


def _holds_tensor(meta: Any) -> bool:
    if isinstance(meta, torch.Tensor):
        return True
    if isinstance(meta, tuple | list):
        return any(_holds_tensor(m) for m in meta)
    return False


def _repacked(graph: fx.Graph, node: fx.Node) -> Any:
    """The structure of ``node``'s value rebuilt from its leaf getitems."""
    meta = tensor_meta(node)
    children = _leaf_getitems(graph, node)
    items = []
    for index, leaf_meta in enumerate(meta):
        child = children.get(index)
        if child is None:
            items.append(leaf_meta)  # a non-tensor constant leaf (None, an int)
        elif isinstance(leaf_meta, tuple | list):
            items.append(_repacked(graph, child))
        else:
            items.append(child)
    return type(meta)(items) if isinstance(meta, tuple) else items


def canonicalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Expose every leaf as a getitem and reroute whole-tuple consumers, in place."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not isinstance(tensor_meta(node), tuple | list) or node.op == "output":
            continue
        if not _holds_tensor(tensor_meta(node)):
            continue
        _leaf_getitems(graph, node)
        for user in list(node.users):
            if is_getitem(user):
                continue
            packed = _repacked(graph, node)
            user.args = _replace(user.args, node, packed)
            user.kwargs = _replace(user.kwargs, node, packed)
    graph.lint()
    gm.recompile()
    return gm


def _replace(obj: Any, old: fx.Node, new: Any) -> Any:
    if obj is old:
        return new
    if isinstance(obj, tuple):
        return tuple(_replace(o, old, new) for o in obj)
    if isinstance(obj, list):
        return [_replace(o, old, new) for o in obj]
    if isinstance(obj, dict):
        return {k: _replace(v, old, new) for k, v in obj.items()}
    return obj
