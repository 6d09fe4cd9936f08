"""Rewrite matrix products with a constant right operand as ``aten.linear``.

Models spell a linear layer in several ways: Hugging Face's ``Conv1D`` (GPT-2) is
``addmm(bias, x, weight)`` with the weight stored ``[in, out]``; hand-written layers use
``x @ w`` or ``mm``. Read as ``linear(x, w.t(), bias)`` they get the linear rules of any
recipe (a per-channel weight, an int32 bias) and the kernels of any backend, with no rule
per spelling. The transpose is a parameter-only computation, folded into a constant next.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.core.values import tensor_meta

aten = torch.ops.aten


def _constant_matrix(arg: object) -> bool:
    """A 2-d parameter or buffer (a ``get_attr``) of a floating dtype."""
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        return False
    val = arg.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 2 and val.is_floating_point()


def _unit_scalars(node: fx.Node) -> bool:
    """``addmm``'s ``beta`` and ``alpha`` are both 1 (anything else is not a plain linear)."""
    return bool(node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1)


def _bias_ok(bias: object, out_features: int) -> bool:
    if not isinstance(bias, fx.Node) or bias.op != "get_attr":
        return False
    val = bias.meta.get("val")
    return isinstance(val, torch.Tensor) and tuple(val.shape) == (out_features,)


def linear_forms(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``addmm(b, x, W)``, ``mm(x, W)`` and ``matmul(x, W)`` (``W`` a constant
    ``[in, out]`` matrix, ``b`` a constant vector) as ``linear(x, W.t(), b)``, in place."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.addmm.default and _unit_scalars(node):
            bias, x, w = node.args[:3]
        elif node.target in (aten.mm.default, aten.matmul.default):
            bias, (x, w) = None, node.args[:2]
        else:
            continue
        if not _constant_matrix(w) or not isinstance(x, fx.Node):
            continue
        assert isinstance(w, fx.Node)
        out_features = int(tensor_meta(w).shape[1])
        if bias is not None and not _bias_ok(bias, out_features):
            continue
        with graph.inserting_before(node):
            weight = graph.call_function(aten.t.default, (w,))
            weight.meta = {**w.meta, "val": tensor_meta(w).t()}
            linear = graph.call_function(aten.linear.default, (x, weight, bias))
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
