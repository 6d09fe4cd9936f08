"""Lowering of what surrounds the kernels: int8 data movement, add/mul/matmul, tables, q/dq.

``dq -> flatten/view/permute/max_pool... -> q`` with the same parameters on both sides is
the movement applied to the int8 tensor itself (quantization is monotonic, so max commutes
with it too). ``dq(a) + dq(b) -> q`` and ``*`` become one native elementwise pass with the
reference's arithmetic; ``dq(a) @ dq(b) -> q`` an int8 matmul of two activations. A
pointwise function between two int8 grids (sigmoid, tanh, ...) becomes a 256-entry table
computed with the reference's own ops; in-place forms (``out += identity``, ``relu_``) lower
the same way when nothing else reads what they overwrite. ``dq -> softmax(last dim) -> q``
is one pass over int8 rows with the 256 possible exponentials tabulated. After every rule
has run, the quantize/dequantize nodes still in the graph (model inputs and outputs, float
islands) become ``quantree.quantize``/``dequantize``: the same arithmetic in one C loop
instead of five ATen ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.saved.derived import Recipe, derived_constant
from quantree.backends.cpu.saved.derived_ops import TABLE_FUNCTIONS, table_recipe_args
from quantree.backends.patterns import (
    Activation,
    activation,
    is_int8_per_tensor,
    replace,
    writes_shared_input,
)
from quantree.core.lower import LoweringContext, Quantized

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
MOVEMENT = (
    aten.flatten.using_ints,
    aten.view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    # views that keep a tensor's values: GhostNet's ``cat(...)[:, :out_chs]``, exported as an
    # ``alias`` (or a ``slice`` where it drops channels), otherwise dequantizes and quantizes
    # the whole map again onto the same grid
    aten.alias.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.select.int,
)


def lower_max_pool(ctx: LoweringContext, node: fx.Node) -> bool:
    """``max_pool2d`` of int8 values on one grid (its output shares its input's parameters)."""
    if node.target is not aten.max_pool2d.default or (io := _same_grid(ctx, node)) is None:
        return False
    x, q = io
    if len(node.meta["val"].shape) != 4:
        return False  # an unbatched [C, H, W] input stays with ATen
    args: Any = [*node.args, *([None] * 6)][:6]
    kernel = _pair(args[1])
    stride = _pair(args[2]) if args[2] else kernel
    padding, dilation = _pair(args[3] or 0), _pair(args[4] or 1)
    with ctx.gm.graph.inserting_before(node):
        pooled = ctx.gm.graph.call_function(
            torch.ops.quantree.max_pool2d.default,
            (x.node, kernel, stride, padding, dilation, bool(args[5])),
        )
    replace(ctx, q.node, pooled, (q.node, node))
    return True


def _pair(value: Any) -> list[int]:
    values = list(value) if isinstance(value, list | tuple) else [value]
    return [int(v) for v in (values * 2 if len(values) == 1 else values)]


def _same_grid(ctx: LoweringContext, node: fx.Node) -> tuple[Activation, Quantized] | None:
    """The int8 input and output of an op that keeps its input's grid (data movement)."""
    x = activation(ctx, node.args[0])
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return None
    if (float(q.params.scale), int(q.params.zero_point)) != (x.scale, x.zero_point):
        return None
    return x, q


def lower_movement(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target not in MOVEMENT or (io := _same_grid(ctx, node)) is None:
        return False
    x, q = io
    graph = ctx.gm.graph
    # int8 tensors may be channels-last (conv outputs): reshape is view where it can be
    target = aten.reshape.default if node.target == aten.view.default else node.target
    with graph.inserting_before(node):
        moved = graph.call_function(target, (x.node, *node.args[1:]), dict(node.kwargs))
    replace(ctx, q.node, moved, (q.node, node))
    return True


POINTWISE = (
    aten.sigmoid.default,
    aten.tanh.default,
    aten.relu.default,
    aten.relu_.default,
    aten.relu6.default,
    aten.clamp.default,
    aten.gelu.default,
    aten.silu.default,
    aten.silu_.default,
    aten.hardswish.default,
    aten.hardswish_.default,
    aten.hardsigmoid.default,
    aten.hardsigmoid_.default,
    aten.hardtanh.default,
    aten.hardtanh_.default,
    aten.leaky_relu.default,
    aten.leaky_relu_.default,
    aten.elu.default,
    aten.elu_.default,
)
"""Pointwise ops tabulated over the 256 input codes; in-place ones when their write is
unobservable (``writes_shared_input``), since the table op does not write its input."""


def lower_pointwise(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq -> sigmoid/tanh/... -> q``: a 256-entry table made by the reference ops."""
    if node.target not in POINTWISE or writes_shared_input(node):
        return False
    x = activation(ctx, node.args[0])
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    codes = torch.arange(-128, 128, dtype=torch.int8)
    values = qd.dequantize_per_tensor(codes, x.scale, x.zero_point, -128, 127, torch.int8)
    fn: Any = node.target
    result = fn(values, *node.args[1:], **node.kwargs)
    out_scale, out_zp = float(q.params.scale), int(q.params.zero_point)
    table = qd.quantize_per_tensor(result, out_scale, out_zp, -128, 127, torch.int8)
    recipe = None
    if str(node.target) in TABLE_FUNCTIONS and len(node.args) == 1 and not node.kwargs:
        grids = (x.scale, x.zero_point, out_scale, out_zp)
        args = table_recipe_args(str(node.target), grids)
        recipe = Recipe(torch.ops.quantree.derived_table.default, args)
    table_node = derived_constant(ctx, "_cpu_table_", table, node, recipe)
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(torch.ops.quantree.lookup.default, (x.node, table_node))
    replace(ctx, q.node, new, (q.node, node))
    return True


BINARY = {
    aten.add.Tensor: "add",
    aten.mul.Tensor: "mul",
    aten.sub.Tensor: "sub",
    aten.add_.Tensor: "add",
    aten.mul_.Tensor: "mul",
    aten.sub_.Tensor: "sub",
}


def lower_binary(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq(a) + dq(b) -> q`` (or ``*``, ``-``) on two int8 activations: one native pass.

    In-place forms (``out += identity``) too, when their write is unobservable.
    """
    kind = BINARY.get(node.target)  # type: ignore[call-overload]
    if kind is None or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    if writes_shared_input(node):
        return False
    a, b = activation(ctx, node.args[0]), activation(ctx, node.args[1])
    q = ctx.quantized_output(node)
    if a is None or b is None or q is None or not is_int8_per_tensor(q.params):
        return False
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(
            torch.ops.quantree.binary.default,
            (
                kind,
                a.node,
                b.node,
                a.scale,
                a.zero_point,
                b.scale,
                b.zero_point,
                float(q.params.scale),
                int(q.params.zero_point),
            ),
        )
    replace(ctx, q.node, new, (q.node, node))
    return True


SOFTMAX = (aten.softmax.int, aten._softmax.default)


def lower_softmax(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq -> softmax(last dim) -> q``: one native pass over int8 rows.

    ``exp(x_i - max x)`` depends only on the code difference, so the 256 exponentials are
    computed here, once, with torch's ``exp``.
    """
    if node.target not in SOFTMAX or _dtype(node) != torch.float32:
        return False
    dim = node.args[1]
    if not isinstance(dim, int) or dim not in (-1, _rank(node.args[0]) - 1):
        return False
    x = activation(ctx, node.args[0])
    q = ctx.quantized_output(node)
    if x is None or q is None or not is_int8_per_tensor(q.params):
        return False
    steps = torch.arange(256, dtype=torch.float32)
    table = ctx.add_constant("_cpu_exp_", torch.exp(-steps * x.scale), before=node)
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(
            torch.ops.quantree.softmax.default,
            (x.node, table, float(q.params.scale), int(q.params.zero_point)),
        )
    replace(ctx, q.node, new, (q.node, node))
    return True


MATMUL = (aten.matmul.default, aten.bmm.default, aten.mm.default)


def lower_matmul(ctx: LoweringContext, node: fx.Node) -> bool:
    """``dq(a) @ dq(b)`` on two int8 activations (at least 2-d each), int8 out through the
    following ``q`` or float out where nothing quantizes the product (attention scores a
    float softmax reads)."""
    if node.target not in MATMUL:
        return False
    a, b = activation(ctx, node.args[0]), activation(ctx, node.args[1])
    q = ctx.quantized_output(node)
    if a is None or b is None or (q is not None and not is_int8_per_tensor(q.params)):
        return False
    if min(_rank(node.args[0]), _rank(node.args[1])) < 2 or _dtype(node) != torch.float32:
        return False
    out_scale, out_zp = (float(q.params.scale), int(q.params.zero_point)) if q else (0.0, 0)
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(
            torch.ops.quantree.matmul.default,
            (a.node, b.node, a.scale, a.zero_point, b.scale, b.zero_point, out_scale, out_zp),
        )
    if q is None:
        new.meta["val"] = node.meta.get("val")
        replace(ctx, node, new, (node,))
    else:
        replace(ctx, q.node, new, (q.node, node))
    return True


def _rank(arg: object) -> int:
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _int8_per_tensor_args(node: fx.Node) -> tuple[float, int] | None:
    _, scale, zero_point, qmin, qmax, dtype = node.args[:6]
    if (qmin, qmax, dtype) != (-128, 127, torch.int8):
        return None
    if not isinstance(scale, float | int) or not isinstance(zero_point, int):
        return None
    return float(scale), int(zero_point)


def native_quantize_dequantize(gm: fx.GraphModule) -> None:
    """Replace the remaining int8 per-tensor q/dq nodes of ``gm`` by the native ops."""
    swap = {
        qd.quantize_per_tensor.default: torch.ops.quantree.quantize.default,
        qd.dequantize_per_tensor.default: torch.ops.quantree.dequantize.default,
    }
    for node in list(gm.graph.nodes):
        new_target = swap.get(node.target)  # type: ignore[call-overload]
        params = _int8_per_tensor_args(node) if new_target is not None else None
        if new_target is None or params is None:
            continue
        if node.kwargs.get("out_dtype", torch.float32) != torch.float32:
            continue
        source = node.args[0]
        if isinstance(source, fx.Node) and source.op == "get_attr":
            continue  # folded constants stay as convert stored them
        with gm.graph.inserting_before(node):
            native = gm.graph.call_function(new_target, (source, *params))
        native.meta = dict(node.meta)
        node.replace_all_uses_with(native)
        gm.graph.erase_node(node)
