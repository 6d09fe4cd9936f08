"""Values that hold -inf or NaN by design stay float, with one warning naming them; so do
the exponents an ``exp`` reads (log-space values, ``exponents``).

Log-space recurrences (xLSTM's log-gate sums under a ``where(causal, x, -inf)``, max
stabilisers over them), attention masks filled with -inf and additive masks carry
infinities on purpose, and the op that ends them (``exp``, ``softmax``) turns them into
finite values again. No integer grid holds an infinity, so a recipe that observed them
refused calibration ("computed NaN or infinity"). ``carrying_infinities`` finds, before
anything is observed, every value a non-finite constant of the model can reach: a fill,
``full``, ``where`` or ``scalar_tensor`` of a non-finite number, or a constant tensor
holding one; followed through every op that passes an infinity on, and stopped where an
op maps it back to finite numbers. ``off_infinities`` wraps a recipe rule so it quantizes
none of those values (an op reading one reads it in float, an op producing one keeps its
output float); the analysis runs once per graph and warns once, naming the points.

Calibration still refuses NaN or infinity everywhere else: there the float model has no
non-finite constant that could have put it there (an overflow, a division by zero).
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from quantree.core.errors import QuantreeWarning
from quantree.core.quantizer import Annotation, Rule
from quantree.core.specs import DerivedSpec, SharedSpec
from quantree.core.values import Use, Value, tensor_meta

aten = torch.ops.aten

FINITE_AGAIN = (
    *(aten.exp, aten.exp_, aten.exp2, aten.softmax, aten._softmax, aten.sigmoid),
    *(aten.tanh, aten.nan_to_num, aten.isinf, aten.isnan, aten.isfinite),
)
"""Ops that map an infinity by design to a finite value: ``exp(-inf) = 0`` (the stabilised
exponent is never +inf: its maximum was subtracted), softmax's masked logits, saturating
activations; the ``is*`` tests give booleans."""

MASKED_ATTENTION = (
    *(aten.scaled_dot_product_attention, aten._scaled_dot_product_attention_math),
    aten._scaled_dot_product_flash_attention_for_cpu,
)
"""Attention ops whose mask may hold -inf by design: the softmax inside ends it, so the
output is finite when the query, key and value (their first three arguments) are; a mask
alone carrying an infinity does not make it one (an attention mask filled with -inf, a
key padding mask, reach ``nn.MultiheadAttention``'s fused call this way)."""

SOURCES = (
    *(aten.masked_fill, aten.masked_fill_, aten.full, aten.full_like, aten.new_full),
    *(aten.fill, aten.fill_, aten.where, aten.scalar_tensor, aten.clamp, aten.clamp_min),
    *(aten.clamp_max, aten.index_put, aten.index_put_, aten.constant_pad_nd),
)
"""Ops whose scalar arguments are values they may write into their output."""


def _non_finite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


CLAMPS = (aten.clamp, aten.clamp_min, aten.clamp_max)
"""Ops whose non-finite scalars are bounds: ``clamp(x, 0, inf)`` (Mamba-2's time-step limit
by default) writes no infinity, only a bound that could never hold (min +inf, max -inf)
or a NaN bound can."""


_BOUNDS = {aten.clamp: ("min", "max"), aten.clamp_min: ("min",), aten.clamp_max: ("max",)}


def _clamp_writes_non_finite(node: fx.Node) -> bool:
    packet: Any = getattr(node.target, "overloadpacket", None)
    names = _BOUNDS.get(packet, ())
    bounds = dict(zip(names, node.args[1:], strict=False))
    bounds.update({k: v for k, v in node.kwargs.items() if k in names})
    low, high = bounds.get("min"), bounds.get("max")
    if not all(b is None or isinstance(b, int | float) for b in (low, high)):
        return any(_non_finite(a) for a in tree_leaves([*node.args[1:], *node.kwargs.values()]))
    return any(
        isinstance(b, float) and (math.isnan(b) or b == bad)
        for b, bad in ((low, math.inf), (high, -math.inf))
    )


def _writes_non_finite(node: fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in SOURCES:
        return False
    if packet in CLAMPS:
        return _clamp_writes_non_finite(node)
    scalars = [*node.args[1:], *node.kwargs.values()]
    if packet in (aten.full, aten.scalar_tensor):
        scalars = [*node.args, *node.kwargs.values()]
    return any(_non_finite(a) for a in tree_leaves(scalars))


def _constant_non_finite(node: fx.Node) -> bool:
    """A ``get_attr`` tensor (a lifted constant: ``where``'s -inf operand) holding one."""
    owner = node.graph.owning_module
    value: object = owner
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    return value.numel() <= 1 << 20 and not bool(torch.isfinite(value).all())


def _float_output(node: fx.Node) -> bool:
    """Any float leaf, float64 included: an infinity carried in float64 reaches the float32
    values cast from it."""
    leaves = tree_leaves(tensor_meta(node))
    return any(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in leaves)


def carrying_infinities(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of ``graph`` (in order, so one pass) whose float output a non-finite
    constant can reach."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            if _constant_non_finite(node):
                found.add(node)
            continue
        if node.op != "call_function" or not _float_output(node):
            continue
        packet = getattr(node.target, "overloadpacket", None)
        reads = any(n in found for n in node.all_input_nodes)
        if packet in FINITE_AGAIN:
            continue
        if packet in MASKED_ATTENTION:
            reads = any(n in found for n in node.args[:3] if isinstance(n, fx.Node))
        if reads or _writes_non_finite(node):
            found.add(node)
    return found


EXPONENTIAL = (aten.exp, aten.exp_, aten.exp2)

LOG_SPACE_CARRIERS = (
    *(aten.add, aten.add_, aten.sub, aten.sub_, aten.rsub, aten.neg, aten.cumsum, aten.sum),
    *(aten.max, aten.maximum, aten.minimum, aten.amax, aten.where, aten.masked_fill),
    *(aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.permute),
    *(aten.transpose, aten.expand, aten.slice, aten.select, aten.clone, aten.contiguous),
    *(aten._to_copy, aten.to, aten.cat, aten.stack, aten.repeat, aten.pad, aten.alias),
)
"""Ops whose output is in log space when it is (sums, maxima, views of log values): an
exponent read through them is followed back to where it was made."""


def exponents(graph: fx.Graph) -> set[fx.Node]:
    """The values an ``exp`` reads, followed back through sums, maxima and views: log-gate
    sums, max stabilisers, log-space decays. An int8 step on an exponent is a relative error
    of the exponential (0.1 in the exponent, 10% of its result), and these values span
    tens of units while their differences decide the result: they stay float."""
    powers = [n for n in graph.nodes if getattr(n.target, "overloadpacket", None) in EXPONENTIAL]
    found: set[fx.Node] = set()
    todo = [a for n in powers for a in n.all_input_nodes[:1]]
    while todo:
        node = todo.pop()
        if node in found or node.op != "call_function" or not _float_output(node):
            continue
        found.add(node)
        packet = getattr(node.target, "overloadpacket", None)
        if packet in LOG_SPACE_CARRIERS or node.target is operator.getitem:
            todo.extend(node.all_input_nodes)
        elif packet in (aten.mul, aten.mul_, aten.div) and len(node.all_input_nodes) == 1:
            todo.extend(node.all_input_nodes)  # a log value scaled by a number
    return found


_FOUND_ATTR = "_quantree_infinities"
"""Attribute on the graph being annotated (prepare's own copy): its analysis with the node
count then, so a graph decomposition grew is redone. On the graph, not in a module-level
table, so nothing is shared between the graphs quantree works on."""


def _infinities_of(graph: fx.Graph) -> set[fx.Node]:
    count = len(graph.nodes)
    known = getattr(graph, _FOUND_ATTR, None)
    if known is not None and known[0] == count:
        return known[1]
    found = carrying_infinities(graph)
    if known is None:
        _warn(found)
    found |= exponents(graph)
    setattr(graph, _FOUND_ATTR, (count, found))
    return found


def _warn(found: set[fx.Node]) -> None:
    named = sorted(
        f"{n.target} at {n.name}" if n.op == "call_function" else f"constant {n.target}"
        for n in found
        if n.op == "get_attr" or n.target is not operator.getitem
    )
    if not named:
        return
    shown = ", ".join(named[:12]) + (f" and {len(named) - 12} more" if len(named) > 12 else "")
    warnings.warn(
        f"{len(named)} value(s) may hold -inf or NaN by design (a mask or fill of a non-finite "
        f"number reaches them) and stay float, as do the ops reading them: {shown}. No "
        "integer grid holds an infinity; from the ops that end them (exp, softmax) on, values "
        "are quantized again.",
        QuantreeWarning,
        stacklevel=2,
    )


def _refers_to(spec: object, node: fx.Node, dropped: set[tuple[Any, ...]], output: bool) -> bool:
    """``spec`` takes its parameters from ``node``'s output (if ``output`` was dropped) or
    from one of its ``dropped`` inputs."""
    targets: tuple[Value | Use, ...] = ()
    if isinstance(spec, SharedSpec):
        targets = (spec.target,)
    elif isinstance(spec, DerivedSpec):
        targets = spec.derived_from
    for t in targets:
        if isinstance(t, Value) and t.node is node and output:
            return True
        if isinstance(t, Use) and t.user is node and tuple(t.arg_path) in dropped:
            return True
    return False


def off_infinities(rule: Rule) -> Rule:
    """``rule`` quantizing no value that may hold an infinity by design."""
    annotate = rule.annotate

    def finite_only(node: fx.Node) -> Annotation | None:
        annotation = annotate(node)
        if annotation is None or annotation.decompose is not None:
            return annotation
        found = _infinities_of(node.graph)
        produces = node in found
        dropped = {
            path
            for path, spec in annotation.inputs.items()
            if spec is not None and Use.of(node, tuple(path)).value.node in found
        }
        if not produces and not dropped:
            return annotation
        inputs = {p: s for p, s in annotation.inputs.items() if p not in dropped}
        outputs = None if produces else annotation.outputs
        kept = [*inputs.values(), *tree_leaves(outputs)]
        if any(_refers_to(s, node, dropped, produces) for s in kept):
            return Annotation()  # parameters shared with what now stays float: all float
        return replace(annotation, inputs=inputs, outputs=outputs)

    return replace(rule, annotate=finite_only)
