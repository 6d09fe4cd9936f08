"""Whether ONNX Runtime's int8 kernels give a q/dq graph's exact numbers on this CPU.

ONNX Runtime fuses ``DequantizeLinear -> Conv/MatMul -> QuantizeLinear`` into its integer
operators. On x86 CPUs without VNNI (AVX2 only: AMD Zen 1-3, Intel before Ice Lake, most
laptops in use) MLAS multiplies u8 x s8 with ``vpmaddubsw``, whose int16 sum of two
products saturates once weights use the full int8 range (2 x 255 x 127 > 32767): ONNX
Runtime's own documentation asks for 7-bit weights (``reduce_range``) there. A graph
calibrated with full-range weights then runs with wrong sums: measured on a Zen 3, a refined
conv + two linears differed from the reference in 88 of 160 outputs by up to 5 output steps
(benchmarks/README.md). With ``session.disable_quant_qdq`` set, ONNX Runtime runs the same
q/dq operators as written (float arithmetic between them, the reference's semantics), and
the outputs are the reference's. ``onnx_session`` does that on such CPUs and says so once.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""Linux ``/proc/cpuinfo`` flags under which MLAS's u8 x s8 products add into int32 exactly."""


def cpu_flags(text: str) -> set[str]:
    """The first ``flags`` line of a ``/proc/cpuinfo`` text, as a set."""
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def saturates(machine: str, flags: set[str] | None) -> bool:
    """True where ONNX Runtime's int8 products can saturate: an x86 CPU whose flags are known
    and hold no VNNI. Unknown flags (another OS) or another architecture: False."""
    if machine.lower() not in ("x86_64", "amd64", "i386", "i686") or flags is None:
        return False
    return not any(flag in flags for flag in VNNI_FLAGS)


@functools.cache
def ort_int8_saturates() -> bool:
    """``saturates`` for this machine (read once per process)."""
    try:
        flags: set[str] | None = cpu_flags(CPUINFO.read_text())
    except OSError:
        flags = None
    return saturates(platform.machine(), flags or None)


WEIGHT_INPUTS = {
    "DynamicQuantizeLSTM": (1, 2),
    "DynamicQuantizeMatMul": (1,),
    "MatMulInteger": (1,),
    "MatMulIntegerToFloat": (1,),
    "ConvInteger": (1,),
    "QLinearMatMul": (3,),
    "QLinearConv": (3,),
}
"""ONNX Runtime's explicit integer operators and which inputs hold their int8 weights: unlike
a q/dq pair, ``session.disable_quant_qdq`` cannot send them back to float."""

SAFE_WEIGHT = 64
"""The widest int8 weight whose pair sums with u8 inputs fit int16 (2 x 255 x 64 < 2**15)."""


def saturating_ops(model: Any) -> list[str]:
    """The explicit integer operators of an ``onnx.ModelProto`` (subgraphs included) that read
    an int8 weight initializer wider than ``SAFE_WEIGHT``: on a CPU where ``ort_int8_saturates``
    their sums can overflow, and nothing but narrower weights avoids it."""
    from onnx import TensorProto, numpy_helper

    subgraphs = list(_graphs(model.graph))
    inits = {i.name: i for graph in subgraphs for i in graph.initializer}
    found = []
    for node in (node for graph in subgraphs for node in graph.node):
        for index in WEIGHT_INPUTS.get(node.op_type, ()):
            init = inits.get(node.input[index] if index < len(node.input) else "")
            if init is None or init.data_type != TensorProto.INT8:
                continue
            widest = int(abs(numpy_helper.to_array(init).astype("int16")).max(initial=0))
            if widest > SAFE_WEIGHT:
                found.append(f"{node.op_type} {node.name or init.name!r}")
                break
    return found


def _graphs(graph: Any) -> Any:
    """``graph`` and every subgraph in it (a Scan's or an If's bodies), depth first."""
    from onnx import AttributeProto

    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _graphs(sub)
