"""fast_attributes: a graph module reads its buffers, submodules without ``Module.__getattr__``.

The generated ``forward`` starts with ``w = self.w`` for every tensor the graph reads. A
buffer is not in the instance's ``__dict__``, so each read falls through to
``Module.__getattr__``, which searches three dictionaries in Python, for every weight of
every call of a small lowered model. fx gives
every graph module its own class, so a property on that class per buffer name reads
``self._buffers`` straight. The buffers stay buffers (``state_dict``, ``named_buffers``,
assignment and deletion go through ``Module`` as before; a deleted one raises
``AttributeError`` as before), and torch's reparametrisation (export, ``functional_call``)
swaps entries of ``_buffers``, which the property reads at every call.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx


def _buffer(name: str, table: str = "_buffers") -> property:
    """The buffer ``name`` (or the submodule, with ``table="_modules"``); once it is none,
    what ``Module`` would find (a plain attribute set later lives in the instance's
    ``__dict__``, written by the setter)."""

    def read(self: Any) -> Any:
        try:
            return getattr(self, table)[name]
        except KeyError:
            if name in self.__dict__:
                return self.__dict__[name]
            raise AttributeError(name) from None  # Module.__getattr__ decides from here

    def write(self: Any, value: Any) -> None:
        self.__dict__[name] = value

    def delete(self: Any) -> None:
        del self.__dict__[name]

    return property(read, write, delete)


def read_buffers_directly(gm: fx.GraphModule) -> fx.GraphModule:
    """Give ``gm``'s own class a property for each top-level buffer its graph reads (in
    place); returns ``gm``. A copy (``deepcopy``) gets a fresh class and reads as before."""
    cls = type(gm)
    if cls.__qualname__.split(".")[-1] != "GraphModuleImpl":  # not fx's per-instance class
        return gm
    for node in gm.graph.find_nodes(op="get_attr"):
        name = node.target
        plain = isinstance(name, str) and "." not in name and name in gm._buffers
        if plain and name not in cls.__dict__ and not hasattr(fx.GraphModule, name):
            setattr(cls, name, _buffer(name))
    # top-level submodules the forward calls (the shape guard ``_guards_fn``, on every call):
    # Module.__setattr__ keeps a module assigned later in ``_modules``, which this reads
    for node in gm.graph.find_nodes(op="call_module"):
        name = node.target
        plain = isinstance(name, str) and "." not in name and name in gm._modules
        if plain and name not in cls.__dict__ and not hasattr(fx.GraphModule, name):
            setattr(cls, name, _buffer(name, "_modules"))
    return gm
