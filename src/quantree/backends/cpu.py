"""``CPU``: the native int8 backend (VNNI kernels built on first use).

Rules, tried in order at each node: whole recurrent layers, linear(+relu), conv2d(+relu),
int8 data movement, int8 add/mul/matmul, pointwise tables. Cells-mode cell bodies are lowered with
the same rules. Then the remaining quantize/dequantize nodes become native ones, and the
module keeps only the tensors its graph still reads, so the reference graph's int8 weights
are not stored twice.
"""

from __future__ import annotations

import copy
import functools

import torch.fx as fx
from torch import nn

from quantree.backend import Backend, LoweringRule, lower
from quantree.backends.lowering_linear import lower_conv2d, lower_linear
from quantree.backends.lowering_qdq import (
    lower_binary,
    lower_matmul,
    lower_movement,
    lower_pointwise,
    native_quantize_dequantize,
)
from quantree.backends.lowering_recurrent import recurrent_rule
from quantree.prepare import GROUPS_KEY


def finish(gm: fx.GraphModule, nested: Backend | None = None) -> fx.GraphModule:
    """Lower nested graphs, native q/dq for what is left, keep only the tensors read."""
    if nested is not None:
        lower_nested(gm, nested)
    native_quantize_dequantize(gm)
    gm.graph.lint()
    gm.recompile()
    lean = fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
    lean.meta = dict(gm.meta)
    return lean


def lower_nested(gm: fx.GraphModule, backend: Backend) -> None:
    """Lower every submodule graph that carries quantree's groups (cells-mode cell bodies).

    The modules on the path to each one are copied first, so the reference model, which
    shares them, is left as it was.
    """
    for name, module in list(gm.named_modules()):
        if name and isinstance(module, fx.GraphModule) and GROUPS_KEY in module.meta:
            *parents, leaf = name.split(".")
            owner: nn.Module = gm
            for part in parents:
                clone = copy.copy(getattr(owner, part))
                clone._modules = dict(clone._modules)
                setattr(owner, part, clone)
                owner = clone
            setattr(owner, leaf, lower(module, backend))


def cpu_backend(hidden_bits: int = 8) -> Backend:
    """The native CPU backend; ``hidden_bits`` is how recurrent layers feed h back.

    8 (``CPU``): int8 like every other activation, the fastest. 16: int16 split into two
    byte planes, one fused VNNI pass; free at batch 1 (the step is memory bound), about 1.2x
    the recurrence cost at large batch, and single-layer recurrences then match the
    reference to 55-65 dB instead of 38-45 dB.
    """
    rules: tuple[LoweringRule, ...] = (
        recurrent_rule(hidden_bits),
        lower_linear,
        lower_conv2d,
        lower_movement,
        lower_binary,
        lower_matmul,
        lower_pointwise,
    )
    name = "cpu" if hidden_bits == 8 else f"cpu-h{hidden_bits}"
    body = Backend(f"{name}-body", rules, prepare_module=finish)
    return Backend(name, rules, prepare_module=functools.partial(finish, nested=body))


CPU = cpu_backend()
"""Native int8 CPU kernels: ``qt.lower(ref, CPU)`` or ``qt.quantize(..., backend=CPU)``."""
