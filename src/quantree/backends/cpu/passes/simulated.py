"""Say which ops a CPU-lowered model still computes in float from quantized inputs.

Such an op reads a dequantized tensor and runs as the reference graph does: the model is
correct, but that part gains nothing from int8 and pays for the conversions. A user who
asked for the CPU backend should hear which ops those are (an A16W8 model, whose int16
activations have no kernel, would otherwise come back as a silent reference graph).

An op that writes its own quantized output is one too (an A16W8 relu after a linear). An op
that reads float and whose result is quantized only on the edge into a kernel is not: under
``WEIGHTED_INPUTS`` a residual add whose sum a convolution reads (ConvNeXt's blocks) computes
in float exactly as the float model does, and the float-op report names it as such.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from quantree.core.annotate import LAYOUT_OPS
from quantree.core.errors import QuantreeWarning
from quantree.core.qdq import DEQUANTIZE_OPS, QUANTIZE_OPS
from quantree.core.stages import node_quant
from quantree.core.values import is_getitem

_NATIVE_QDQ = ("quantree.quantize.default", "quantree.dequantize.default")


def _is_qdq(node: object, reference_ops: tuple[object, ...]) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    return node.target in reference_ops or str(node.target) in _NATIVE_QDQ


def simulated_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """Compute ops of ``gm`` that read a dequantize of an activation or whose own output the
    recipe quantized (a quantize reads it)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node):
            continue
        if _is_qdq(node, QUANTIZE_OPS + DEQUANTIZE_OPS):
            continue
        if getattr(node.target, "overloadpacket", None) in LAYOUT_OPS:
            continue
        if str(node.target).startswith("quantree."):
            continue
        reads = any(
            _is_qdq(a, DEQUANTIZE_OPS) and a.args and a.args[0].op != "get_attr"  # type: ignore[union-attr]
            for a in node.all_input_nodes
        )
        info = node_quant(node)
        own_output = info is not None and bool(info.output_groups)
        writes = own_output and any(_is_qdq(u, QUANTIZE_OPS) for u in node.users)
        if reads or writes:
            found.append(node)
    return found


def warn_simulated(gm: fx.GraphModule, backend: str) -> None:
    """One QuantreeWarning naming the ops ``simulated_ops`` finds, if any."""
    ops = simulated_ops(gm)
    if not ops:
        return
    shown = ", ".join(f"{n.target} at {n.name}" for n in ops[:12])
    more = f" and {len(ops) - 12} more" if len(ops) > 12 else ""
    warnings.warn(
        f"backend {backend}: {len(ops)} op(s) have no int8 kernel for their inputs and run in "
        f"float between quantize/dequantize, as in the reference graph: {shown}{more}. "
        "Kernels exist for int8 activations (Int8Quantizer); int16 activations "
        "(A16W8Quantizer) and these ops are simulated",
        QuantreeWarning,
        stacklevel=5,
    )
