"""What the CPU lowering rules read from a reference graph: int8 activations and weights.

Each helper answers "is this argument what an int8 kernel can consume?" and returns the
integer tensor (a graph node or a folded constant) with its parameters, or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext
from quantree.core.qdq import QUANTIZE_PER_TENSOR
from quantree.core.specs import QDtype, QParams
from quantree.core.stages import OUTPUT_GRID_KEY, REPLACES_KEY, VALUE_OF_KEY

aten = torch.ops.aten
RELU = (aten.relu.default, aten.relu_.default)
INT8_RANGE = (-128, 127)


@dataclass(frozen=True)
class Activation:
    """An int8 per-tensor activation: the node producing the integers, and its parameters."""

    node: fx.Node
    scale: float
    zero_point: int


@dataclass(frozen=True)
class Weight:
    """A folded int8 weight with symmetric per-output-channel scales (float32 ``[N]``)."""

    values: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Output:
    """Where a lowered op's result goes: the node it replaces and, if int8, its parameters."""

    replaces: fx.Node
    scale: float  # 0.0: the op produces float
    zero_point: int
    relu: bool


def is_int8_per_tensor(p: QParams) -> bool:
    return p.axis is None and p.dtype == QDtype.INT8 and (p.quant_min, p.quant_max) == INT8_RANGE


def activation(
    ctx: LoweringContext, arg: object, allow_constant: bool = False
) -> Activation | None:
    """``arg`` read through an int8 per-tensor dequantize (a folded constant if allowed)."""
    dq = ctx.dequantized(arg)
    if dq is None or not is_int8_per_tensor(dq.params):
        return None
    if dq.is_constant and not allow_constant:
        return None
    return Activation(dq.source, float(dq.params.scale), int(dq.params.zero_point))


def writes_shared_input(node: fx.Node) -> bool:
    """Whether ``node`` is an in-place op whose write another node could observe.

    ``out += identity`` or ``relu_`` between q/dq writes into the tensor a dequantize made;
    when that dequantize has no other reader, the write is lost with it, and the out-of-place
    native op computes exactly what the reference does.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    written = node.args[0] if node.args else None
    return not (isinstance(written, fx.Node) and list(written.users) == [node])


def weight(ctx: LoweringContext, arg: object) -> Weight | None:
    dq = ctx.dequantized(arg)
    if dq is None or not dq.is_constant or dq.params.dtype != QDtype.INT8:
        return None
    p = dq.params
    if bool((p.zero_point != 0).any()) or p.axis not in (None, 0):
        return None
    values = fetch_attr(ctx.gm, str(dq.source.target))
    scale = p.scale.float().reshape(-1).expand(values.shape[0]).contiguous()
    return Weight(values, scale)


def float_constant(ctx: LoweringContext, arg: object, size: int) -> torch.Tensor | None:
    """A bias as float32 ``[size]``: dequantized if stored as integers; zeros when absent."""
    if arg is None:
        return torch.zeros(size)
    dq = ctx.dequantized(arg)
    if dq is not None and dq.is_constant:
        return ctx.constant(dq).float().reshape(size).contiguous()
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return fetch_attr(ctx.gm, str(arg.target)).detach().float().reshape(size).contiguous()
    return None


def output(ctx: LoweringContext, node: fx.Node, allow_float: bool = True) -> Output | None:
    """``node -> quantize``, ``node -> relu -> quantize``, or (``allow_float``) plain float.

    A relu whose output stays float (a transformer's FFN under ``WEIGHTED_INPUTS``) is not
    fused: the op writes float and the relu runs after it as it did.
    """
    users = list(node.users)
    relu = len(users) == 1 and users[0].target in RELU
    tail = users[0] if relu else node
    q = ctx.quantized_output(tail)
    if q is not None and is_int8_per_tensor(q.params):
        return Output(q.node, float(q.params.scale), int(q.params.zero_point), relu)
    if not allow_float:
        return None
    return Output(node, 0.0, 0, False)


def constant(ctx: LoweringContext, prefix: str, value: torch.Tensor, before: fx.Node) -> fx.Node:
    node = ctx.add_constant(prefix, value.contiguous(), before=before)
    node.meta["val"] = value
    return node


def mark_provenance(old: fx.Node, new: fx.Node, path: tuple[int, ...] = ()) -> None:
    """Record on ``new`` which reference Value it computes, and its int8 grid if ``old`` is
    the quantize of that Value, so the numeric debugger can read kernels' outputs."""
    source = old.args[0] if old.target == QUANTIZE_PER_TENSOR else old
    if not isinstance(source, fx.Node):
        return
    new.meta.setdefault(REPLACES_KEY, (source.name, path))
    if VALUE_OF_KEY in source.meta and not path:
        new.meta.setdefault(VALUE_OF_KEY, source.meta[VALUE_OF_KEY])
    if old.target == QUANTIZE_PER_TENSOR:
        scale, zero_point = old.args[1], old.args[2]
        if isinstance(scale, float | int) and isinstance(zero_point, int):
            new.meta.setdefault(OUTPUT_GRID_KEY, (float(scale), zero_point))


def replace(ctx: LoweringContext, old: fx.Node, new: fx.Node, chain: Sequence[fx.Node]) -> None:
    """Route ``old``'s users to ``new``, then erase the now dead ``chain`` (users first).

    ``new`` takes the module scope of the first of ``old`` and ``chain`` that has one (the
    quantize nodes convert inserts have none), so reports still place the kernel.
    """
    scopes = (n.meta.get("nn_module_stack") for n in (old, *chain))
    new.meta["nn_module_stack"] = next((s for s in scopes if s), {})
    mark_provenance(old, new)
    old.replace_all_uses_with(new)
    for node in chain:
        if not node.users:
            ctx.gm.graph.erase_node(node)
