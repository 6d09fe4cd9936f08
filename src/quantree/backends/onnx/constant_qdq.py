"""Quantize/dequantize pairs on constants, folded to the float value they compute.

The reference graph quantizes a recurrent layer's initial states on their own grid; when the
model passes none, they are zeros, and the export writes ``zeros -> QuantizeLinear ->
DequantizeLinear`` in front of the layer. OpenVINO's CPU plugin then refuses the ``LSTM``
at batch sizes above one (``LSTMSequence ... expects Constant for port 4``). ``dq(q(c))`` of
a constant is itself a constant (zeros stay exact zeros), so the pair is replaced by its
value, computed with ONNX's rounding (half to even, saturating, and the ``Clip`` of a
narrowed range), for an initializer or a ``ConstantOfShape`` fill.

With the states folded, OpenVINO compiles the layer but takes its own u8 route for it when
the weights are ``DequantizeLinear`` of int8, and that route computes wrong numbers. No
runtime has an integer QDQ pattern for ``LSTM``/``GRU``/``RNN`` (ONNX Runtime dequantizes
such weights again on every call), so in the portable export their ``W``, ``R`` and ``B``
are written as the float values the reference graph computes with, dequantized once here:
the same numbers, in every runtime, at float speed. ONNX Runtime's int8 layers are the other
target (``ort_target``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _scalar(reader: dict[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    if name not in reader:
        return None
    value = numpy_helper.to_array(reader[name])
    return value if value.size == 1 else None


def fold_constant_qdq(model: onnx.ModelProto) -> int:
    """Replace every ``Q [-> Clip] -> DQ`` chain on a constant of ``model``'s main graph by
    that chain's value; the number folded."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    folded = 0
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) < 2:
            continue
        chain = _chain(node, producers)
        if chain is None:
            continue
        q, clip = chain
        source = q.input[0]
        params = _params(inits, q, node, clip)
        if params is None:
            continue
        if source in inits:
            value = _qdq(numpy_helper.to_array(inits[source]).astype(np.float32), *params)
            name = f"{node.output[0]}_folded"
            graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
            new = helper.make_node("Identity", [name], list(node.output), name=node.name)
        elif source in producers and producers[source].op_type == "ConstantOfShape":
            fill = producers[source]
            attr = next((a for a in fill.attribute if a.name == "value"), None)
            raw = numpy_helper.to_array(attr.t) if attr is not None else np.zeros(1, np.float32)
            value = _qdq(raw.astype(np.float32).reshape(1), *params).astype(np.float32)
            new = helper.make_node(
                "ConstantOfShape",
                [fill.input[0]],
                list(node.output),
                name=node.name,
                value=numpy_helper.from_array(value),
            )
        else:
            continue
        replacements[id(node)] = [new]
        folded += 1
    if folded:
        nodes = [r for n in graph.node for r in replacements.get(id(n), [n])]
        del graph.node[:]
        graph.node.extend(nodes)
    return folded


def float_recurrent_weights(model: onnx.ModelProto) -> int:
    """Give every ``LSTM``/``GRU``/``RNN`` its constant ``W``/``R``/``B`` as float
    initializers (their dequantized values); the number of inputs replaced."""
    from quantree.backends.onnx.ort_constants import ConstantReader
    from quantree.backends.onnx.ort_target import RECURRENT, drop_dead

    reader = ConstantReader(model)
    replaced = 0
    for node in model.graph.node:
        if node.op_type not in RECURRENT:
            continue
        for k in range(1, min(4, len(node.input))):
            name = node.input[k]
            if not name or name in reader.initializers:
                continue
            value = reader.array(name)
            if value is None:
                continue
            folded = f"{node.name or node.output[0]}_{'WRB'[k - 1]}"
            model.graph.initializer.append(
                numpy_helper.from_array(value.astype(np.float32), folded)
            )
            node.input[k] = folded
            replaced += 1
    if replaced:
        drop_dead(model.graph)
    return replaced


def _chain(
    dq: onnx.NodeProto, producers: dict[str, onnx.NodeProto]
) -> tuple[onnx.NodeProto, onnx.NodeProto | None] | None:
    """The ``QuantizeLinear`` (and ``Clip``) in front of ``dq``."""
    first = producers.get(dq.input[0])
    clip = None
    if first is not None and first.op_type == "Clip":
        clip, first = first, producers.get(first.input[0])
    if first is None or first.op_type != "QuantizeLinear":
        return None
    return first, clip


def _params(
    inits: dict[str, onnx.TensorProto],
    q: onnx.NodeProto,
    dq: onnx.NodeProto,
    clip: onnx.NodeProto | None,
) -> tuple[float, int, int, int, float, int] | None:
    """Per-tensor ``(q_scale, q_zp, lo, hi, dq_scale, dq_zp)``, or None."""
    got = [_scalar(inits, n) if n else None for n in (*q.input[1:3], *dq.input[1:3])]
    if any(g is None for g in got) or len(q.input) < 3 or len(dq.input) < 3:
        return None
    qs, qz, ds, dz = got
    assert qs is not None and qz is not None and ds is not None and dz is not None
    info = np.iinfo(qz.dtype)
    lo, hi = int(info.min), int(info.max)
    if clip is not None:
        bounds = [_scalar(inits, n) if n else None for n in clip.input[1:3]]
        if len(bounds) != 2 or any(b is None for b in bounds):
            return None
        lo, hi = max(lo, int(bounds[0])), min(hi, int(bounds[1]))  # type: ignore[arg-type]
    return float(qs), int(qz), lo, hi, float(ds), int(dz)


def _qdq(x: np.ndarray, qs: float, qz: int, lo: int, hi: int, ds: float, dz: int) -> np.ndarray:
    q = np.clip(np.rint(x / np.float32(qs)) + qz, lo, hi)
    return ((q - dz) * np.float32(ds)).astype(np.float32)
