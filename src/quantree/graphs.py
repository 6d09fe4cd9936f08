"""Small graph utilities shared by the passes."""

from __future__ import annotations

import torch
import torch.fx as fx


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with its own graph; parameters are shared, never written to.

    Passes rewrite the copy, so the module the caller handed in stays as it was.
    """
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    graph._codegen = gm.graph._codegen  # input/output pytree specs: read-only, shared
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for name, child in gm.named_children():  # observers of constants have no call node
        if not hasattr(new, name):
            new.add_module(name, child)
    new.meta = dict(gm.meta)
    return new


def unique_attr(gm: torch.nn.Module, prefix: str) -> str:
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


def register_constant(gm: fx.GraphModule, prefix: str, value: torch.Tensor) -> str:
    """Store a tensor on ``gm`` as a buffer and return its attribute name."""
    name = unique_attr(gm, prefix)
    gm.register_buffer(name, value)
    return name


def fetch_attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    """The tensor a ``get_attr`` node reads."""
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, torch.Tensor), target
    return obj
