"""4-bit weights (``qt.W4A8Quantizer``) written as ONNX ``int4`` QDQ (opset 21).

The reference graph keeps a 4-bit weight as pt2e does: int8 storage with
``quant_min=-8, quant_max=7`` on its dequantize. ``torch.onnx`` writes that as an int8
initializer read by ``DequantizeLinear``; here each such initializer whose values all lie in
[-8, 7], and its zero point, become ``INT4`` (two values a byte in the file), so runtimes
that read int4 QDQ (ONNX Runtime's ``MatMulNBits`` fusion, for one) see 4-bit weights. Opset
21 is the first with ``int4``: an export of a graph with 4-bit weights at a lower opset is
refused, naming ``opset=21``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.graphs import nested_graphs
from quantree.core.qdq import DEQUANTIZE_OPS

INT4_OPSET = 21
INT4_RANGE = (-8, 7)


def has_int4_weights(gm: fx.GraphModule) -> bool:
    """``gm`` dequantizes an int8 tensor on the 4-bit grid [-8, 7] (a 4-bit weight)."""
    graphs = [gm, *nested_graphs(gm).values()]
    return any(
        node.op == "call_function"
        and node.target in DEQUANTIZE_OPS
        and node.args[-1] == torch.int8
        and tuple(node.args[-3:-1]) == INT4_RANGE
        for g in graphs
        for node in g.graph.nodes
    )


def int4_opset(gm: fx.GraphModule, opset: int | None) -> int | None:
    """The opset to export ``gm`` at: 21 where it has 4-bit weights and none was asked for;
    a lower one asked for is refused."""
    if not has_int4_weights(gm):
        return opset
    if opset is None:
        return INT4_OPSET
    if opset < INT4_OPSET:
        raise QuantreeError(
            f"export_onnx: the graph has 4-bit weights (quant_min=-8, quant_max=7), which ONNX "
            f"writes as int4 from opset {INT4_OPSET}; opset {opset} has no int4: pass "
            f"opset={INT4_OPSET} (or leave opset unset), or quantize with 8-bit weights"
        )
    return opset


def _only_zero_point_of_fitting(name: str, nodes: list, fits: Callable[[str], bool]) -> bool:
    """``name`` fits [-8, 7] and is read only as the zero point of ``DequantizeLinear``
    nodes whose input fits too (so the pair can change type together)."""
    return fits(name) and all(
        n.op_type == "DequantizeLinear" and list(n.input[2:3]) == [name] and fits(n.input[0])
        for n in nodes
    )


def int4_initializers(path: str | os.PathLike[str]) -> int:
    """Rewrite the model at ``path``: each int8 initializer read only by
    ``DequantizeLinear`` (as its input) with every value in [-8, 7], and that node's zero
    point, as ``INT4``. Returns how many weights were rewritten."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    rewritten: set[str] = set()

    def fits(name: str) -> bool:
        init = inits.get(name)
        if init is None or init.data_type != onnx.TensorProto.INT8:
            return False
        values = numpy_helper.to_array(init)
        return values.size > 0 and bool(((values >= -8) & (values <= 7)).all())

    weights = 0
    for name, nodes in readers.items():
        if not nodes or not fits(name):
            continue
        if any(n.op_type != "DequantizeLinear" or n.input[0] != name for n in nodes):
            continue
        zero_points = [n.input[2] for n in nodes if len(n.input) > 2 and n.input[2]]
        if not all(_only_zero_point_of_fitting(z, readers[z], fits) for z in zero_points):
            continue
        for each in (name, *zero_points):
            if each in rewritten:
                continue
            values = numpy_helper.to_array(inits[each]).astype(np.int8)
            four = helper.make_tensor(
                each, onnx.TensorProto.INT4, list(values.shape), values.reshape(-1).tolist()
            )
            inits[each].CopyFrom(four)
            rewritten.add(each)
        weights += 1
    if weights:
        onnx.save(model, str(path))
    return weights
