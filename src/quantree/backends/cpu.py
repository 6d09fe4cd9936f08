"""``CPU``: the native int8 backend (VNNI kernels built on first use).

Rules, tried in order at each node: whole recurrent layers, linear(+relu), conv2d(+relu).
After lowering, the module keeps only the tensors its graph still reads, so the reference
graph's int8 weights are not stored twice.
"""

from __future__ import annotations

import torch.fx as fx

from quantree.backend import Backend
from quantree.backends.lowering_linear import lower_conv2d, lower_linear
from quantree.backends.lowering_recurrent import lower_recurrent


def drop_unused_tensors(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over the same graph holding only the attributes it reads."""
    lean = fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
    lean.meta = dict(gm.meta)
    return lean


CPU = Backend(
    "cpu",
    rules=(lower_recurrent, lower_linear, lower_conv2d),
    prepare_module=drop_unused_tensors,
)
"""Native int8 CPU kernels: ``qt.lower(ref, CPU)`` or ``qt.quantize(..., backend=CPU)``."""
