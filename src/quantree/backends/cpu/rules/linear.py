"""Lowering rules for ``linear`` and ``conv1d``/``conv2d`` (each optionally followed by ``relu``).

Pattern: ``dq(x int8) -> linear/conv(dq(W int8), dq(b int32)) [-> relu] -> q``. The
replacement reads the int8 ``x`` directly and writes the int8 result, so a chain of lowered
layers never leaves int8. Integer biases whose scale is exactly input x weight scale are
added to the int32 accumulator (the kernel is then exact); others are added in float. The
offset and scale of each call site are saved as recipes on the shared float bias, weight
scales and row sums (``derived.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.native.packing import pack, zero_point_offset
from quantree.backends.cpu.ops.gemm import is_depthwise
from quantree.backends.cpu.saved.derived import Recipe, bias_source, derived_constant, summed
from quantree.backends.patterns import (
    Activation,
    Output,
    Weight,
    activation,
    constant,
    float_constant,
    output,
    replace,
    weight,
)
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext

aten = torch.ops.aten
quantree_ops = torch.ops.quantree


@dataclass(frozen=True)
class _Terms:
    """``y = (acc + offset) * scale (+ bias)``, and the recipes of offset and scale when they
    derive from tensors every call site shares (``derived.py``)."""

    offset: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    offset_recipe: Recipe | None
    scale_recipe: Recipe


def accumulator_terms(
    ctx: LoweringContext,
    x: Activation,
    w: Weight,
    bias_arg: object,
    packed: torch.Tensor,
    groups: int = 1,
) -> _Terms | None:
    """(int32 offset, float32 scale, float bias or None) of ``y = (acc + offset) * scale``."""
    n = w.values.shape[0]
    scale = (x.scale * w.scale).float()
    scale_recipe = Recipe(quantree_ops.derived_scale.default, (w.scale, x.scale))
    offset = zero_point_offset(w.values, x.zero_point)
    sums = summed(w.values, packed, groups)
    dq = ctx.dequantized(bias_arg) if bias_arg is not None else None
    if dq is not None and dq.is_constant and dq.params.dtype.torch_dtype == torch.int32:
        bias_scale = dq.params.scale.float().reshape(-1).expand(n)
        if torch.equal(bias_scale, scale) and bool((dq.params.zero_point == 0).all()):
            stored = fetch_attr(ctx.gm, str(dq.source.target)).reshape(n).to(torch.int32)
            source = bias_source(ctx, bias_arg)
            recipe = None
            if source is not None:
                recipe = Recipe(
                    quantree_ops.derived_offset.default,
                    (sums, source.bias, source.weight_scale, source.input_scale, x.zero_point),
                )
            return _Terms(offset + stored, scale, None, recipe, scale_recipe)
    bias = float_constant(ctx, bias_arg, n)
    if bias is None:
        return None
    recipe = Recipe(
        quantree_ops.derived_offset.default, (sums, None, w.scale, x.scale, x.zero_point)
    )
    return _Terms(offset, scale, bias if bias_arg is not None else None, recipe, scale_recipe)


def replace_bias(
    terms: _Terms, scale: torch.Tensor, scale_recipe: Recipe, bias: torch.Tensor | None
) -> _Terms:
    """``terms``'s offset on another accumulator scale with a float bias (an int16 input's
    dual pass: the hi plane's offset, the lo plane's scale)."""
    return dataclasses.replace(terms, scale=scale, scale_recipe=scale_recipe, bias=bias)


def lowered_constants(
    ctx: LoweringContext, node: fx.Node, packed: torch.Tensor, terms: _Terms
) -> list[fx.Node | None]:
    """The kernel's weight, offset, scale and bias arguments, stored on the module."""
    return [
        constant(ctx, "_cpu_weight_", packed, node),
        derived_constant(ctx, "_cpu_offset_", terms.offset, node, terms.offset_recipe),
        derived_constant(ctx, "_cpu_scale_", terms.scale, node, terms.scale_recipe),
        None if terms.bias is None else constant(ctx, "_cpu_bias_", terms.bias, node),
    ]


def replaced_chain(node: fx.Node, out: Output) -> list[fx.Node]:
    chain = [out.replaces]
    if out.relu:
        chain.append(next(iter(node.users)))
    if out.replaces is not node:
        chain.append(node)
    return chain


def lower_linear(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.target != aten.linear.default:
        return False
    x, w = activation(ctx, node.args[0]), weight(ctx, node.args[1])
    out = output(ctx, node)
    if x is None or w is None or out is None or w.values.dim() != 2:
        return False
    packed = pack(w.values)
    terms = accumulator_terms(ctx, x, w, node.args[2] if len(node.args) > 2 else None, packed)
    if terms is None:
        return False
    args = lowered_constants(ctx, node, packed, terms)
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            quantree_ops.linear.default,
            (x.node, *args, w.values.shape[0], out.scale, out.zero_point, out.relu),
        )
    replace(ctx, out.replaces, new, replaced_chain(node, out))
    return True


CONVOLUTIONS = {
    aten.conv1d.default: 1,
    aten.conv1d.padding: 1,
    aten.conv2d.default: 2,
    aten.conv2d.padding: 2,
}
"""The convolutions lowered, by number of spatial dimensions."""


def int_list(v: object, dims: int, default: int) -> list[int]:
    """A stride/dilation/padding argument as ``dims`` ints (an int or a 1-list broadcasts)."""
    if v is None:
        return [default] * dims
    items: list[Any] = list(v) if isinstance(v, list | tuple) else [v]
    return [int(i) for i in (items * dims if len(items) == 1 else items)]


def _padding(v: object, kernel: list[int], dilation: list[int]) -> list[int] | None:
    """Padding before each spatial dim, then after it if that differs ('same', even kernel).

    'same' pads ``dilation * (kernel - 1)`` in all, the odd one after, as PyTorch does.
    """
    if v == "valid":
        return [0] * len(kernel)
    if v != "same":
        return None if isinstance(v, str) else int_list(v, len(kernel), 0)
    total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    begin = [t // 2 for t in total]
    end = [t - b for t, b in zip(total, begin, strict=True)]
    return begin if begin == end else [*begin, *end]


def pack_conv_weight(values: torch.Tensor, groups: int) -> torch.Tensor:
    """``[O, C / groups, *kernel]`` as the conv kernels read it: ``[taps, C]`` for a
    depthwise convolution; otherwise rows ordered (*kernel, c), each group's ``O / groups``
    rows packed on their own, the groups one after the other."""
    out_channels = values.shape[0]
    if is_depthwise(values.shape[1] * groups, out_channels, groups):
        return values.reshape(out_channels, -1).t().contiguous()
    rows = values.permute(0, *range(2, values.dim()), 1)
    return torch.cat([pack(part) for part in rows.chunk(groups)])


def native_conv_pays(in_channels: int, out_channels: int, groups: int, narrow: bool) -> bool:
    """Whether the int8 kernels beat the reference's float conv (between native q/dq).

    A grouped conv runs one GEMM per group, which fills ``out_channels / groups`` of its 16
    output lanes, so narrow groups stop paying against the float conv with native q/dq
    around it (the ratios by group width: benchmarks/README.md, "Figures moved from
    docstrings"). Depthwise convs have a direct kernel. So have 2-d int8 convs with fewer than
    16 channels a group (``narrow``: the route that reaches ``csrc/conv_narrow.cpp``, every
    group's products in one pass); elsewhere (int16 inputs, ``[N, C, L]`` conv1d) such
    groups stay float.
    """
    if groups == 1 or is_depthwise(in_channels, out_channels, groups):
        return True
    return narrow or out_channels // groups >= 16


def conv_geometry(
    args: list[Any], values: torch.Tensor, dims: int, narrow: bool = False
) -> tuple[int, list[int], list[int], list[int], list[int], int] | None:
    """(out channels, kernel, stride, padding, dilation, groups) of a conv call's ``args``,
    or None when its padding has no native form or its groups are too narrow to pay
    (``native_conv_pays``; ``narrow``: the int8 conv2d's narrow-group kernel is there)."""
    groups = 1 if args[6] is None else args[6]
    out_channels, in_per_group = values.shape[:2]
    if not isinstance(groups, int) or not native_conv_pays(
        in_per_group * groups, out_channels, groups, narrow
    ):
        return None
    kernel = [int(k) for k in values.shape[2:]]
    dilation = int_list(args[5], dims, 1)
    padding = _padding(args[4], kernel, dilation)
    if padding is None:
        return None
    return int(out_channels), kernel, int_list(args[3], dims, 1), padding, dilation, groups


def lower_conv2d(ctx: LoweringContext, node: fx.Node) -> bool:
    """conv1d / conv2d (+relu), any padding (also 'same'/'valid'), stride, dilation, groups.

    A conv1d is ``quantree.conv1d``, on the conv2d's packed weight and arithmetic, reading
    and writing ``[N, C, L]`` as it lies (``ops/conv1d.py``); groups run one GEMM per group on
    that group's channels, depthwise convs a direct kernel, conv2d groups of fewer than 16
    output channels one direct pass over all groups; conv1d groups too narrow to pay stay in
    the reference form (``native_conv_pays``).
    """
    dims = CONVOLUTIONS.get(node.target)  # type: ignore[call-overload]
    if dims is None:
        return False
    a = list(node.args) + [None] * (7 - len(node.args))
    x, w = activation(ctx, a[0]), weight(ctx, a[1])
    out = output(ctx, node)
    if x is None or w is None or out is None or w.values.dim() != dims + 2:
        return False
    if _rank(a[0]) != dims + 2:  # an unbatched input ([C, H, W]): the kernels read [N, C, ...]
        return False
    geometry = conv_geometry(a, w.values, dims, narrow=dims == 2)
    if geometry is None:
        return False
    out_channels, kernel, stride, padding, dilation, groups = geometry
    packed = pack_conv_weight(w.values, groups)
    terms = accumulator_terms(ctx, x, w, a[2], packed, groups)
    if terms is None:
        return False
    args = lowered_constants(ctx, node, packed, terms)
    shape = (out_channels, kernel, stride, padding, dilation)
    target = quantree_ops.conv1d if dims == 1 else quantree_ops.conv2d
    with ctx.gm.graph.inserting_before(node):
        new = ctx.gm.graph.call_function(
            target.default,
            (x.node, *args, *shape, x.zero_point, out.scale, out.zero_point, out.relu, groups),
        )
    replace(ctx, out.replaces, new, replaced_chain(node, out))
    return True


def _rank(arg: object) -> int | None:
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None
