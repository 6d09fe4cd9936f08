"""Small graph utilities shared by the passes."""

from __future__ import annotations

import copy

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
    owner, leaf = owner_of(gm, target)
    obj = getattr(owner, leaf)
    assert isinstance(obj, torch.Tensor), target
    return obj


def owner_of(root: torch.nn.Module, target: str) -> tuple[object, str]:
    """The object holding attribute path ``target`` (``"a.b.c"``) of ``root``, and ``"c"``."""
    *parents, leaf = target.split(".")
    owner: object = root
    for part in parents:
        owner = getattr(owner, part)
    return owner, leaf


def attr_at(root: torch.nn.Module, target: str) -> object | None:
    """Attribute path ``target`` of ``root``, or None where a part of it is missing."""
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def drop_attr(root: torch.nn.Module, target: str) -> None:
    """Remove attribute path ``target`` of ``root`` if it is there."""
    owner, leaf = owner_of(root, target)
    if hasattr(owner, leaf):
        delattr(owner, leaf)


def replace_submodule(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Set ``root.<name> = new`` after copying the modules on the way (shallowly).

    Passes that replace a nested module this way leave every other module that shares the
    old path (the model they were given) as it was.
    """
    *parents, leaf = name.split(".")
    owner = root
    for part in parents:
        clone = copy.copy(getattr(owner, part))
        clone._modules = dict(clone._modules)
        setattr(owner, part, clone)
        owner = clone
    setattr(owner, leaf, new)


def nested_graphs(module: torch.nn.Module) -> dict[str, fx.GraphModule]:
    """The outermost GraphModules strictly inside ``module``, by qualified name.

    This is the one way passes find nested graphs (a cell loop's body): prepare observes
    them, convert converts them, backends lower them, tools record inside them. A graph
    nested in a nested graph is that graph's own business.
    """
    found: dict[str, fx.GraphModule] = {}

    def visit(prefix: str, m: torch.nn.Module) -> None:
        for name, child in m.named_children():
            qualified = f"{prefix}{name}"
            if isinstance(child, fx.GraphModule):
                found[qualified] = child
            else:
                visit(qualified + ".", child)

    visit("", module)
    return found
