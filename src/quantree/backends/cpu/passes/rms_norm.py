"""RMSNorm written as five ATen ops, recognised as one ``aten.rms_norm``.

LLaMA, Mistral and T5 compute their norm as ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) +
eps)`` times a weight: export keeps ``pow``, ``mean``, ``add``, ``rsqrt`` and two ``mul``s,
six dispatcher calls per norm, each a value a region program (``passes/regions.py``) cannot
take apart (a ``[rows, 1]`` mean broadcast back over the row). As one ``rms_norm`` the norm is
a single instruction of a program (``RMS_NORM`` in ``csrc/qt_program.h``), as layer norm is.
Outside a program ATen's ``rms_norm`` computes the same formula (float rounding aside).
Only the exact form is matched: every intermediate read once, the mean over the last
dimension with ``keepdim``, the weight (if any) a constant of the last dimension's size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import attr_at

aten = torch.ops.aten


def _only_user(n: fx.Node, target: object) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 and users[0].target == target else None


def _val(n: object) -> torch.Tensor | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _other(n: fx.Node, one: object) -> object:
    """The operand of a binary ``n`` that is not ``one`` (None: neither or both are)."""
    a: Any = n.args
    if len(a) != 2 or n.kwargs or (a[0] is one) == (a[1] is one):
        return None
    return a[1] if a[0] is one else a[0]


def _match(square: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """``(x, eps, chain)`` of the form starting at ``square``, ``pow(x, 2)``: ``chain`` is
    ``pow``, ``mean``, ``add``, ``rsqrt``, and last the product ``x * rsqrt(...)``; None if
    ``square`` does not start one."""
    a: Any = square.args
    x, val = a[0], _val(a[0])
    if len(a) != 2 or a[1] != 2 or val is None or val.dtype != torch.float32 or not val.ndim:
        return None
    mean = _only_user(square, aten.mean.dim)
    if mean is None:
        return None
    m: Any = mean.args
    dims = list(m[1]) if len(m) > 1 and m[1] is not None else []
    keep = m[2] if len(m) > 2 else mean.kwargs.get("keepdim", False)
    if [d % val.ndim for d in dims] != [val.ndim - 1] or not keep or mean.kwargs.get("dtype"):
        return None
    add = _only_user(mean, aten.add.Tensor)
    eps = _other(add, mean) if add is not None else None
    if add is None or not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    rsqrt = _only_user(add, aten.rsqrt.default)
    product = _only_user(rsqrt, aten.mul.Tensor) if rsqrt is not None else None
    if (
        rsqrt is None
        or product is None
        or _other(product, rsqrt) is not x
        or not isinstance(x, fx.Node)
    ):
        return None
    return x, float(eps), [square, mean, add, rsqrt, product]


def _weight(gm: fx.GraphModule, product: fx.Node, cols: int) -> tuple[fx.Node, fx.Node] | None:
    """``(weight, scaled)`` where ``product``'s one reader multiplies it by a float32
    constant of ``cols`` elements, else None."""
    scaled = _only_user(product, aten.mul.Tensor)
    weight = _other(scaled, product) if scaled is not None else None
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or scaled is None:
        return None
    value = attr_at(gm, str(weight.target))
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    out, before = _val(scaled), _val(product)
    if list(value.shape) != [cols] or out is None or before is None or out.shape != before.shape:
        return None
    return weight, scaled


def recognise_rms_norm(gm: fx.GraphModule) -> int:
    """Replace each five-op RMSNorm of ``gm`` (and the weight's ``mul`` after it) by one
    ``aten.rms_norm``; returns how many."""
    graph = gm.graph
    found = 0
    for square in list(graph.nodes):
        if square.op != "call_function" or square.target != aten.pow.Tensor_Scalar:
            continue
        match = _match(square)
        if match is None:
            continue
        x, eps, chain = match
        cols = int(x.meta["val"].shape[-1])
        weighted = _weight(gm, chain[-1], cols)
        last = weighted[1] if weighted else chain[-1]
        with graph.inserting_before(last):
            norm = graph.call_function(
                aten.rms_norm.default, (x, [cols], weighted[0] if weighted else None, eps)
            )
        norm.meta = dict(last.meta)
        last.replace_all_uses_with(norm)
        for n in reversed([*chain, last] if weighted else chain):
            graph.erase_node(n)
        found += 1
    if found:
        graph.lint()
        gm.recompile()
    return found
