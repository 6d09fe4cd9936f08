"""The ONNX Runtime target: recurrent layers of the QDQ export rewritten to run in int8 there.

In the QDQ graph torch's exporter writes, ``LSTM``/``GRU``/``RNN`` read ``W``/``R`` from
``DequantizeLinear``: no runtime has a QDQ pattern for them, so ONNX Runtime would run the
float kernel and dequantize the int8 weights again on every call (slower than not quantizing;
the portable target gives them float weights instead, see ``constant_qdq``). Here, per
operator:

- ``LSTM`` -> ``com.microsoft.DynamicQuantizeLSTM``, ONNX Runtime's own int8 LSTM (what its
  ``quantize_dynamic`` emits): int8 ``W``/``R`` stored transposed with per-row scales, the
  input projection of every step as one int8 GEMM and each step's ``R`` product in int8. It is
  given quantree's calibrated int8 weights and scales unchanged; the activations it quantizes
  per step itself (its operator has no input for static activation scales).
- ``GRU``/``RNN``: ONNX Runtime has no integer operator for them; ``ort_recurrence`` writes
  them as ``DynamicQuantizeMatMul`` products (int8 weights, stored once) in a ``Scan``; a
  layer too small for the ``Scan`` to beat the float kernel (``scan_is_slower``) stays float
  and is named.

A custom-op library (``com.quantree`` loaded with ``register_custom_ops_library``) would run
quantree's own kernels, but it must be compiled against ONNX Runtime's C API headers, which
the ``onnxruntime`` wheel does not ship; the contrib operators need nothing but the wheel.
Biases are folded to float initializers once. Whatever cannot be rewritten (weights that are
not int8 constants with zero points at zero) stays float and is named by the caller.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantree.backends.onnx.ort_constants import ConstantReader, QuantizedConstant
from quantree.backends.onnx.ort_weights import per_tensor

MS_DOMAIN = "com.microsoft"
RECURRENT = ("LSTM", "GRU", "RNN")


def _symmetric_int8(q: QuantizedConstant | None) -> bool:
    return q is not None and q.values.dtype == np.int8 and not q.zero_point.any()


class Rewriter:
    """Rewrites ``model`` in place; ``float_ops`` names the recurrent nodes left float."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.reader = ConstantReader(model)
        self.float_ops: list[str] = []
        self.taken: set[str] = {i.name for i in self.graph.initializer}
        self._shapes: dict[str, list[int | None]] | None = None

    def initializer(self, base: str, value: np.ndarray) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        self.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def unquantized(self, name: str) -> str:
        """The float value a ``QuantizeLinear`` -> ``DequantizeLinear`` pair rounds into
        ``name``, or ``name``. The integer operators quantize their float input themselves
        (per call, to their own grid); rounding it to the static grid first as well would
        round every element twice, for no int8 step saved."""
        dq = self.reader.producers.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return name
        q = self.reader.producers.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            return name
        return str(q.input[0])

    def wide_input(self, name: str) -> bool:
        """Whether ``name`` is dequantized from a 16-bit grid (an A16W8 recipe's activation):
        the integer operators quantize their input to uint8, losing what 16 bits keep."""
        dq = self.reader.producers.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
            return False
        zp = self.reader.array(dq.input[2]) if dq.input[2] else None
        return zp is not None and zp.dtype.itemsize >= 2

    def unless_zeros(self, name: str) -> str:
        """``""`` for an all-zero constant, also when quantized and dequantized or expanded to
        the batch (an absent initial state is zeros in ONNX, and the kernel then skips
        reading one: no zeros made and quantized per call), else ``name``."""
        if not name:
            return name
        source = self.unquantized(name)  # quantize/dequantize keep a zero exactly zero
        node = self.reader.producers.get(source)
        if node is not None and node.op_type in ("Identity", "Expand"):
            source = node.input[0]  # nn.LSTM without hx: zeros expanded to the batch
        if source not in self.reader.initializers and source not in self.reader.producers:
            return name
        value = self.reader.array(source)
        return "" if value is not None and not value.any() else name

    def batch(self, node: onnx.NodeProto) -> int | None:
        """The fixed batch size of a recurrent ``node``'s input, None when it is free or
        unknown (ONNX's shape inference over the standard graph, before any rewrite)."""
        if self._shapes is None:
            self._shapes = {}
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model).graph
            except Exception:  # an unknown op or shape: no fixed batch is claimed
                return None
            for value in (*inferred.value_info, *inferred.input, *inferred.output):
                dims = value.type.tensor_type.shape.dim
                self._shapes[value.name] = [
                    d.dim_value if d.HasField("dim_value") else None for d in dims
                ]
        dims = self._shapes.get(node.input[0])
        axis = 0 if _attr_int(node, "layout") == 1 else 1  # X: [seq, batch, in] unless layout=1
        if dims is None or len(dims) != 3:
            return None
        return dims[axis]

    def run(self) -> list[str]:
        from quantree.backends.onnx.ort_recurrence import can_scan, scan_is_slower, scan_recurrence

        nodes = list(self.graph.node)
        rewritten: list[onnx.NodeProto] = []
        for node in nodes:
            if node.op_type not in RECURRENT or node.domain not in ("", "ai.onnx"):
                rewritten.append(node)
                continue
            W, R = self.reader.quantized(node.input[1]), self.reader.quantized(node.input[2])
            why = None if node.op_type == "LSTM" else can_scan(node)
            if why is None and node.op_type != "LSTM":
                why = scan_is_slower(node, self.batch(node))
            if not (_symmetric_int8(W) and _symmetric_int8(R)):
                why = "weights not int8 constants with zero points at zero"
            if self.wide_input(node.input[0]):
                why = "16-bit input: the integer operators would quantize it to 8 bits"
            if why is not None:
                self.float_ops.append(f"{node.op_type} {node.name} ({why})")
                rewritten.append(node)
                continue
            assert W is not None and R is not None
            B = self.reader.array(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            if node.op_type == "LSTM":
                rewritten.append(self._lstm(node, W, R, B))
            else:
                rewritten.extend(scan_recurrence(self, node, W, R, B))
        del self.graph.node[:]
        self.graph.node.extend(rewritten)
        drop_dead(self.graph)
        uses_ms = any(n.domain == MS_DOMAIN for n in self.graph.node)
        if uses_ms and not any(o.domain == MS_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        return self.float_ops

    def _lstm(
        self, node: onnx.NodeProto, W: QuantizedConstant, R: QuantizedConstant, B: object
    ) -> onnx.NodeProto:
        name = node.name or node.output[0]
        # one scale per weight where the rows allow, as ORT's own quantizer lays them out
        # (ort_weights says why); otherwise quantree's per-row scales
        W, R = per_tensor(W, shared=True) or W, per_tensor(R, shared=True) or R
        w = self.initializer(f"{name}_W_int8", np.ascontiguousarray(W.values.transpose(0, 2, 1)))
        r = self.initializer(f"{name}_R_int8", np.ascontiguousarray(R.values.transpose(0, 2, 1)))
        inputs = [self.unquantized(node.input[0]), w, r]
        if isinstance(B, np.ndarray):
            inputs.append(self.initializer(f"{name}_B", B.astype(np.float32)))
        else:
            inputs.append("")
        rest = [self.unless_zeros(n) for n in node.input[4:8]]
        inputs += rest + [""] * (4 - len(rest))  # sequence_lens, initial_h, initial_c, P
        inputs += [
            self.initializer(f"{name}_W_scale", W.scale.astype(np.float32)),
            self.initializer(f"{name}_W_zero_point", W.zero_point.astype(np.int8)),
            self.initializer(f"{name}_R_scale", R.scale.astype(np.float32)),
            self.initializer(f"{name}_R_zero_point", R.zero_point.astype(np.int8)),
        ]
        attributes = {
            a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "layout"
        }
        return helper.make_node(
            "DynamicQuantizeLSTM",
            inputs,
            list(node.output),
            name=f"{name}_int8",
            domain=MS_DOMAIN,
            **attributes,
        )


def _attr_int(node: onnx.NodeProto, name: str) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(helper.get_attribute_value(a))
    return 0


def drop_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes and initializers nothing reads any more (the replaced weights' DQs)."""
    live = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output) or not node.output:
            kept.append(node)
            live.update(i for i in node.input if i)
            live.update(_subgraph_inputs(node))
    del graph.node[:]
    graph.node.extend(reversed(kept))
    unused = [i for i in graph.initializer if i.name not in live]
    for init in unused:
        graph.initializer.remove(init)


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (``Scan``/``Loop`` bodies) read from the outer scope."""
    names: set[str] = set()
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            for inner in a.g.node:
                names.update(i for i in inner.input if i)
                names.update(_subgraph_inputs(inner))
    return names


def to_onnxruntime(model: onnx.ModelProto) -> list[str]:
    """Rewrite ``model``'s recurrent operators for ONNX Runtime's integer kernels in place;
    the ones left float (``"LSTM node_name"``)."""
    return Rewriter(model).run()
