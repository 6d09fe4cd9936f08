"""Read the tanh approximation of GELU, spelled out in elementwise ops, as one ``gelu``.

GPT-2, GPT-J, CodeGen and Phi write ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 *
x ** 3)))`` by hand (Hugging Face's ``NewGELUActivation``): eight ATen ops over the widest
activation of the block. As ``aten.gelu(x, approximate="tanh")`` the same function is one
pass in float, and a recipe that quantizes activations sees one op (one table lookup in a
backend) instead of eight rounded steps. The result agrees with the chain to float rounding
(the two evaluate the same formula; measured within 5e-7 of it).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def _close(value: object, expected: float) -> bool:
    return isinstance(value, int | float) and math.isclose(value, expected, rel_tol=1e-6)


def _sole_use(node: object) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1


def _times_scalar(node: object, scalar: float) -> fx.Node | None:
    """The tensor ``t`` of ``node = mul(t, scalar)`` (either order), else None."""
    if not isinstance(node, fx.Node) or node.target is not aten.mul.Tensor:
        return None
    a, b = node.args[:2]
    if isinstance(a, fx.Node) and _close(b, scalar):
        return a
    if isinstance(b, fx.Node) and _close(a, scalar):
        return b
    return None


def _plus_one(node: fx.Node) -> fx.Node | None:
    """The tensor ``t`` of ``node = add(t, 1)`` (either order), else None."""
    if node.target is not aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args[:2]
    if isinstance(a, fx.Node) and _close(b, 1.0):
        return a
    if isinstance(b, fx.Node) and _close(a, 1.0):
        return b
    return None


def _cubic_inner(node: object) -> fx.Node | None:
    """``x`` of ``x + 0.044715 * x ** 3`` (either order of the sum), else None."""
    if not isinstance(node, fx.Node) or node.target is not aten.add.Tensor:
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    for x, term in (node.args[:2], node.args[1::-1]):
        cube = _times_scalar(term, _CUBIC)
        if (
            isinstance(x, fx.Node)
            and cube is not None
            and _sole_use(term)
            and _sole_use(cube)
            and cube.target is aten.pow.Tensor_Scalar
            and cube.args[0] is x
            and _close(cube.args[1], 3.0)
        ):
            return x
    return None


def _match(tanh: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, out)`` when ``tanh`` sits in ``out = (x * 0.5) * (tanh(...) + 1)``."""
    scaled = tanh.args[0]
    inner = _times_scalar(scaled, _SQRT_2_OVER_PI)
    x = _cubic_inner(inner)
    if x is None or not (_sole_use(scaled) and _sole_use(inner) and _sole_use(tanh)):
        return None
    one_plus = next(iter(tanh.users))
    if _plus_one(one_plus) is not tanh or not _sole_use(one_plus):
        return None
    out = next(iter(one_plus.users))
    if out.target is not aten.mul.Tensor or len(out.args) != 2:
        return None
    half = out.args[1] if out.args[0] is one_plus else out.args[0]
    if _times_scalar(half, 0.5) is not x or not _sole_use(half):
        return None
    return x, out


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, transitively, the chain nodes it alone was reading (the matched
    ops only: anything else, however dead, is not this pass's to remove)."""
    pending = [node]
    while pending:
        current = pending.pop()
        if current.users or current.op != "call_function":
            continue
        if current.target not in (aten.mul.Tensor, aten.add.Tensor, aten.pow.Tensor_Scalar,
                                  aten.tanh.default):  # fmt: skip
            continue
        inputs = [a for a in current.args if isinstance(a, fx.Node)]
        graph.erase_node(current)
        pending += inputs


def gelu_forms(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each spelled-out tanh GELU by ``aten.gelu(x, approximate="tanh")``, in place."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.tanh.default:
            continue
        found = _match(node)
        if found is None:
            continue
        x, out = found
        with graph.inserting_before(out):
            gelu = graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
        gelu.meta = dict(out.meta)
        out.replace_all_uses_with(gelu)
        _erase_unused(graph, out)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
