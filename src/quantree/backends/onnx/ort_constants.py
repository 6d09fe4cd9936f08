"""Constant subgraphs of an exported ONNX model, evaluated once at export.

The QDQ export gives a recurrent operator its weights as ``DequantizeLinear`` of int8
initializers (one per direction, joined by ``Concat``), and its biases as ``DequantizeLinear``
of int32 ones. The ONNX Runtime target hands int8 weights with their scales to an integer
operator and the biases as float initializers; this module reads those constant subgraphs
back, with numpy, from the closed set of ops the export emits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper


@dataclass(frozen=True)
class QuantizedConstant:
    """An int8 weight ``[dirs, rows, cols]``, a scale and zero point per row ``[dirs, rows]``."""

    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray


class ConstantReader:
    """Reads values of ``model`` that depend only on initializers and ``Constant`` nodes."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.initializers = {i.name: i for i in graph.initializer}
        self.producers = {o: n for n in graph.node for o in n.output}

    def array(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is an initializer, a ``Constant``, a ``DequantizeLinear``
        or a ``Concat`` of such; None otherwise."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producers.get(name)
        if node is None:
            return None
        if node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t) if node.attribute else None
        if node.op_type == "Concat":
            parts = [self.array(i) for i in node.input]
            if any(p is None for p in parts):
                return None
            return np.concatenate(parts, axis=_attr(node, "axis", 0))  # type: ignore[arg-type]
        if node.op_type == "DequantizeLinear":
            q = self.quantized(name)
            if q is None:
                return None
            per_row = q.scale.shape + (1,) * (q.values.ndim - 2)
            zp = q.zero_point.reshape(per_row).astype(np.float32)
            return (q.values.astype(np.float32) - zp) * q.scale.reshape(per_row)
        return None

    def quantized(self, name: str) -> QuantizedConstant | None:
        """``name`` as an integer constant with per-row parameters: a ``DequantizeLinear`` of
        a rank-3 (``[1, rows, cols]``, axis 1 or per tensor) or rank-2 (``[1, rows]`` biases)
        initializer, or a ``Concat`` of those along axis 0 (directions)."""
        node = self.producers.get(name)
        if node is None:
            return None
        if node.op_type == "Concat" and _attr(node, "axis", 0) == 0:
            parts = [self.quantized(i) for i in node.input]
            if any(p is None for p in parts):
                return None
            return QuantizedConstant(
                np.concatenate([p.values for p in parts]),  # type: ignore[union-attr]
                np.concatenate([p.scale for p in parts]),  # type: ignore[union-attr]
                np.concatenate([p.zero_point for p in parts]),  # type: ignore[union-attr]
            )
        if node.op_type != "DequantizeLinear" or node.input[0] not in self.initializers:
            return None
        values = numpy_helper.to_array(self.initializers[node.input[0]])
        scale = self.array(node.input[1])
        zp = self.array(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is None or values.ndim not in (2, 3) or values.shape[0] != 1:
            return None
        rows = values.shape[1]
        axis = _attr(node, "axis", 1)
        if scale.size == 1:
            scale = np.full(rows, float(scale.reshape(())), np.float32)
        elif scale.shape != (rows,) or axis % values.ndim != 1:
            return None
        if zp is None:
            zp = np.zeros(rows, values.dtype)
        elif zp.size == 1:
            zp = np.full(rows, zp.reshape(()), values.dtype)
        elif zp.shape != (rows,):
            return None
        return QuantizedConstant(values, scale[None].astype(np.float32), zp[None])


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default
