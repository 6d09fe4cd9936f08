"""Casts to the dtype a value already has, and the dtype checks export puts before them,
removed after lowering.

Hugging Face's norms write ``hidden_states.to(torch.float32)`` on float32 activations; export
keeps each as ``aten.to.dtype`` (which returns its input unchanged) preceded by an
``_assert_tensor_metadata`` on the same value. Neither computes anything, but both read the
value: a region program (``passes/regions.py``) ends wherever an op it does not run reads
one of its values, so every RMSNorm of LLaMA or T5 cut the regions around it, and each is a
dispatcher call on every forward. The dtypes of computed values are fixed by the graph's ops,
and so are the constants', so the check on them cannot fail at run time; checks on the
graph's inputs stay. ``to(dtype=, layout=, device=)`` (``aten.to.dtype_layout``, what
``.to(x.device)`` or ``.type(dtype)`` on a float32 value become) is the same identity when
nothing it names differs from the value's own, and so is ``type_as(x, other)`` where both are
of one dtype (RecurrentGemma's RMSNorm ends in ``.type_as(x)``: seven region cuts a forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import attr_at

aten = torch.ops.aten


def _dtype(gm: fx.GraphModule, n: fx.Node) -> torch.dtype | None:
    val = attr_at(gm, str(n.target)) if n.op == "get_attr" else n.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _computed(n: object, inputs: bool) -> bool:
    """A value the graph makes or holds (a constant), not one the caller passes (or, with
    ``inputs``, any value)."""
    ops = ("call_function", "get_attr", "placeholder") if inputs else ("call_function", "get_attr")
    return isinstance(n, fx.Node) and n.op in ops


def _same_layout(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n`` is an ``aten.to.dtype_layout`` that changes nothing of its input."""
    a: Any = n.args
    val = n.meta.get("val")
    src = a[0].meta.get("val") if isinstance(a[0], fx.Node) else None
    if len(a) != 1 or not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    kw = n.kwargs
    if set(kw) - {"dtype", "layout", "device", "pin_memory", "non_blocking", "copy"}:
        return False
    return (
        kw.get("dtype") in (None, _dtype(gm, a[0]))
        and val.dtype == src.dtype
        and kw.get("layout") in (None, src.layout)
        and kw.get("device") in (None, src.device)
        and not kw.get("pin_memory")
        and not kw.get("copy")
    )


def _same_type(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n`` is an ``aten.type_as`` whose output (of ``other``'s dtype by definition)
    has its input's dtype: it returns its input then. ``other`` may be a lowered op's output,
    which has no metadata of its own."""
    a: Any = n.args
    if n.target != aten.type_as.default or n.kwargs or len(a) != 2:
        return False
    dtype = _dtype(gm, a[0])
    return dtype is not None and dtype == _dtype(gm, n)


def drop_identity_casts(gm: fx.GraphModule, inputs: bool = False) -> int:
    """Remove ``to(dtype)`` of a computed value already of that dtype and the dtype checks on
    computed values that agree with the graph; returns how many nodes went. ``inputs``: the
    graph's inputs count as computed (a folded step's inputs are cut from the outer graph's
    values, where the unrolled step's check read a computed ``select`` and went too)."""
    graph = gm.graph
    dropped = 0
    for n in list(graph.nodes):
        a: Any = n.args
        if n.op != "call_function" or not a or not _computed(a[0], inputs):
            continue
        if n.target == aten._assert_tensor_metadata.default:
            dtype = n.kwargs.get("dtype", a[3] if len(a) > 3 else None)
            sized = any(x is not None for x in a[1:3]) or n.kwargs.get("size") is not None
            sized = sized or n.kwargs.get("stride") is not None
            if dtype is not None and dtype == _dtype(gm, a[0]) and not sized and not n.users:
                graph.erase_node(n)
                dropped += 1
        elif (
            (
                n.target == aten.to.dtype
                and not n.kwargs
                and len(a) == 2
                and a[1] == _dtype(gm, a[0]) == _dtype(gm, n)
            )
            or (n.target == aten.to.dtype_layout and _same_layout(gm, n))
            or _same_type(gm, n)
        ):
            n.replace_all_uses_with(a[0])
            graph.erase_node(n)
            dropped += 1
    if dropped:
        graph.lint()
        gm.recompile()
    return dropped
