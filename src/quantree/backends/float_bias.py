"""Float biases a runtime would quantize to int32 and clamp: found for the exporters.

``convert`` keeps a layer's bias float where int32 on the grid input scale x weight scale
cannot hold it (``core/grouping/overflow.py``). Runtimes that fuse ``dq -> conv/linear -> q``
into an integer kernel quantize a float bias themselves, on that same grid: XNNPACK does,
and so does ONNX Runtime (its QDQ fusion of ``Conv``/``Gemm``), and both then compute with
a bias cut to a fraction of its value. The exporters ask :func:`beyond_int32` and keep such
a layer's bias out of the fused kernel (its reference numbers stay).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.core.graphs import fetch_attr, register_constant
from quantree.core.qdq import is_dequantize, params_of

aten = torch.ops.aten
WEIGHTED = {
    aten.linear.default,
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv1d.padding,
    aten.conv2d.padding,
    aten.conv3d.padding,
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
}
"""Ops whose argument 2 is a bias added to input x weight."""
INT32_MAX = float(torch.iinfo(torch.int32).max)


def beyond_int32(layer: fx.Node) -> bool:
    """Whether ``layer`` reads dequantized input and weight and a float constant bias whose
    values pass the int32 range on the grid input scale x weight scale.

    The check takes the smallest weight scale for every channel: a runtime's grid is per
    output channel, and keeping a bias that would have fit out of a fused kernel costs speed,
    never numbers.
    """
    if layer.op != "call_function" or layer.target not in WEIGHTED or len(layer.args) < 3:
        return False
    x, w, bias = layer.args[:3]
    if not (is_dequantize(x) and is_dequantize(w)):
        return False
    if not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
        return False
    gm = layer.graph.owning_module
    assert isinstance(x, fx.Node) and isinstance(w, fx.Node) and gm is not None
    value = fetch_attr(gm, str(bias.target))
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    grid = params_of(x, gm).scale.double().min() * params_of(w, gm).scale.double().min()
    return bool(value.detach().double().abs().max() / grid > INT32_MAX)


def bias_apart(gm: fx.GraphModule) -> list[fx.Node]:
    """Move each bias :func:`beyond_int32` finds out of its layer, into a float ``add`` after
    it: the layer is then no ``dq -> op -> q`` pattern a runtime fuses with its bias, and
    adds the same float bias the reference does. Returns the layers."""
    moved = []
    for node in list(gm.graph.nodes):
        if not beyond_int32(node):
            continue
        bias, weight = node.args[2], node.args[1]
        assert isinstance(bias, fx.Node) and isinstance(weight, fx.Node)
        value = fetch_attr(gm, str(bias.target)).detach()
        w = weight.meta.get("val")
        spatial = 0 if node.target == aten.linear.default or w is None else w.dim() - 2
        shaped = value.reshape(-1, *([1] * spatial))
        with gm.graph.inserting_after(node):
            constant = gm.graph.get_attr(register_constant(gm, "_bias_apart_", shaped))
        constant.meta["val"] = shaped
        with gm.graph.inserting_after(constant):
            added = gm.graph.call_function(aten.add.Tensor, (node, constant))
        added.meta = {**node.meta}
        node.replace_all_uses_with(added, delete_user_cb=lambda user, new=added: user is not new)
        node.args = (*node.args[:2], None, *node.args[3:])
        moved.append(node)
    if moved:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return moved
