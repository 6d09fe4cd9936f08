"""A freed loop graph's values in terms of a length symbol (``free.py``'s second half).

Once the integers export pinned are read from the input's size, the nodes' ``val`` metadata
still holds the captured sizes; a pass that compiles for them (the CPU backend's region
programs) would fix the captured length again. So each size (and stride) that grew by ``k``
in the capture one step longer becomes ``k * s + c`` of a new symbol ``s`` of the capture's
shape environment.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx


def length_symbol(nodes: list[fx.Node], length: int) -> Any:
    """A new size symbol standing for the freed length, in the capture's shape environment:
    the node values then say which sizes follow the length (a region program compiled from
    them reads it at run time instead of fixing the captured one). None where the capture has
    no shape environment."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    mode = detect_fake_mode([n.meta.get("val") for n in nodes])
    env = getattr(mode, "shape_env", None)
    if env is None:
        return None
    from torch._dynamo.source import ConstantSource

    source = ConstantSource(f"quantree_length_{len(env.var_to_val)}")
    sym = env.create_symbol(length, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(sym, hint=length, source=source)


def symbolic_val(val: Any, longer: Any, symbol: Any, length: int) -> Any:
    """``val`` with each size that grew by ``k`` in ``longer`` (captured one step longer) as
    ``k * symbol + c``; ``val`` itself where the two differ otherwise."""
    if isinstance(val, (tuple, list)) and isinstance(longer, (tuple, list)):
        if len(val) != len(longer):
            return val
        pairs = zip(val, longer, strict=True)
        return type(val)(symbolic_val(v, w, symbol, length) for v, w in pairs)
    if not isinstance(val, torch.Tensor) or not isinstance(longer, torch.Tensor):
        return val
    if val.dim() != longer.dim() or val.shape == longer.shape:
        return val
    shape: list[Any] = []
    for x, y in zip(val.shape, longer.shape, strict=True):
        if not (type(x) is int and type(y) is int) or x == y:
            shape.append(x)
            continue
        slope = y - x
        shape.append(symbol * slope + (x - slope * length))
    mode = val.fake_mode if hasattr(val, "fake_mode") else None
    if mode is None:
        return val
    strides = _strides(val, longer, symbol, length)
    with mode:  # the capture's layout kept: a pass that reads strides sees the real ones
        return torch.empty_strided(shape, strides, dtype=val.dtype, device=val.device)


def _strides(val: torch.Tensor, longer: torch.Tensor, symbol: Any, length: int) -> list[Any]:
    """``val``'s strides, each that grew by ``k`` in ``longer`` as ``k * symbol + c`` (a
    stride over a dimension that follows the length); a stride that did not grow kept."""
    out: list[Any] = []
    for x, y in zip(val.stride(), longer.stride(), strict=True):
        if type(x) is int and type(y) is int and x != y:
            out.append(symbol * (y - x) + (x - (y - x) * length))
        else:
            out.append(x)
    return out


def eval_size(node: fx.Node, symbol: Any, size: fx.Node) -> Any:
    """A size node's value in terms of ``symbol`` (``size`` is the symbol itself), set as its
    ``val`` and on the nodes it is computed from."""
    a, b = node.args
    x: Any = symbol if a is size else eval_size(a, symbol, size) if isinstance(a, fx.Node) else a
    value = x * b if node.target is operator.mul else x + b
    node.meta["val"] = value
    return value
