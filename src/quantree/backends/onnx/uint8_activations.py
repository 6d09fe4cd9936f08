"""int8 activation quantize/dequantize pairs written as uint8 at opset 21 and above.

ONNX Runtime's extended graph optimizations run two passes that disagree from opset 21 on:
``QDQPropagationTransformer`` copies a ``DequantizeLinear`` past a data-movement op
(``Unsqueeze`` before a ``Concat``, ``Reshape``, ``Transpose``) as a new ``QuantizeLinear``/
``DequantizeLinear`` pair, and at opset 21 writes the new ``QuantizeLinear``'s
``output_dtype`` attribute (INT8); ``QDQS8ToU8Transformer`` then moves the int8 pair to
uint8 by changing its zero point only, and the session refuses to load (``output_dtype INT8
does not match y_zero_point type UINT8``). Opset 21 is what an int16 point needs (cells
mode's int16 cell state, gates and sums), so every such export hit it.

Here each activation pair (a ``QuantizeLinear`` with an int8 zero point whose every reader is
a ``DequantizeLinear``, possibly through the ``Clip`` of a narrowed range) is written on
uint8 with its zero point and clip bounds moved by 128: the same integers shifted, so every
runtime computes the same floats, and ONNX Runtime has nothing left to move to uint8.
uint8 activations are ONNX's own convention (the default zero-point type); weights, read from
int8 initializers, stay int8.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

FIRST_OPSET = 21
SHIFT = 128


def opset_of(model: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def uint8_activations(model: onnx.ModelProto) -> int:
    """Move ``model``'s int8 activation pairs to uint8 (opset 21 and above, main graph);
    the number of pairs moved."""
    if opset_of(model) < FIRST_OPSET:
        return 0
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    shifted: dict[str, str] = {}  # int8 initializer -> its uint8 copy

    def moved(name: str) -> str:
        if name not in shifted:
            value = numpy_helper.to_array(inits[name]).astype(np.int16) + SHIFT
            new = f"{name}_u8"
            graph.initializer.append(numpy_helper.from_array(value.astype(np.uint8), new))
            shifted[name] = new
        return shifted[name]

    def int8_scalar(name: str) -> bool:
        init = inits.get(name)
        return init is not None and init.data_type == onnx.TensorProto.INT8

    count = 0
    retyped: set[str] = set()  # values now uint8, whose recorded type says int8
    for q in graph.node:
        if q.op_type != "QuantizeLinear" or len(q.input) < 3 or not int8_scalar(q.input[2]):
            continue
        if any(a.name == "output_dtype" for a in q.attribute):
            continue
        dqs, clips = _readers_through_clips(q.output[0], readers, outputs)
        if dqs is None or any(len(d.input) < 3 or not int8_scalar(d.input[2]) for d in dqs):
            continue
        if any(not all(int8_scalar(b) for b in c.input[1:] if b) for c in clips):
            continue
        q.input[2] = moved(q.input[2])
        retyped.update([q.output[0], *(c.output[0] for c in clips)])
        for clip in clips:
            for k in range(1, len(clip.input)):
                if clip.input[k]:
                    clip.input[k] = moved(clip.input[k])
        for dq in dqs:
            dq.input[2] = moved(dq.input[2])
        count += 1
    for info in graph.value_info:
        if info.name in retyped and info.type.HasField("tensor_type"):
            info.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    nested = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                 for node in graph.node for a in node.attribute)  # fmt: skip
    if count and not nested:  # a subgraph may read an outer initializer: keep them all then
        used = {name for node in graph.node for name in node.input} | outputs
        used |= {i.name for i in graph.input}
        gone = {name for name in shifted if name not in used}
        kept = [i for i in graph.initializer if i.name not in gone]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return count


def _readers_through_clips(
    name: str, readers: dict[str, list[onnx.NodeProto]], outputs: set[str]
) -> tuple[list[onnx.NodeProto] | None, list[onnx.NodeProto]]:
    """The ``DequantizeLinear`` nodes reading ``name`` (directly or through one ``Clip``), and
    those clips; None when anything else reads it (the pair is then left as it is)."""
    dqs: list[onnx.NodeProto] = []
    clips: list[onnx.NodeProto] = []
    if name in outputs or not readers.get(name):
        return None, clips
    for reader in readers[name]:
        if reader.op_type == "DequantizeLinear" and reader.input[0] == name:
            dqs.append(reader)
        elif reader.op_type == "Clip" and reader.input[0] == name:
            inner, _ = _readers_through_clips(reader.output[0], readers, outputs)
            if inner is None or any(r.op_type != "DequantizeLinear" for r in inner):
                return None, clips
            clips.append(reader)
            dqs.extend(inner)
        else:
            return None, clips
    return dqs, clips
