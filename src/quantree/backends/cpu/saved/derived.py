"""Per-call-site constants saved as a recipe on tensors the call sites share.

An int32 bias lives on the grid input scale x weight scale, so each call site of one layer
(an unrolled decoder's 16 steps) has integers of its own, and so has what lowering folds from
them: a linear's accumulator offset and output scale, a recurrent layer's dequantized bias, a
program's requantization multipliers, a lookup table made from two grids. ``share_identical``
cannot merge those; stored as they are they made the seq2seq model's saved file 20-40% larger
than its int8 weights.

Lowering computes each such constant with one of the ops of ``saved/derived_ops.py``, from the
float bias, the weight's scales (the same tensors at every call site) and the call site's
grids (numbers), and records the call about the constant tensor itself (:func:`remember`,
``core.annotations``), only after checking that it gives the constant bit for bit. Recording
it about the tensor, not on the graph node reading it, reaches every holder of the constant:
the top graph, a native cell loop's constants, a region program's. (A deep copy of the
lowered model has new tensors: it saves its constants as they are.) The model in memory
reads the constant as before. ``save`` writes the call instead of the constant
(``saved/derived_export.py``), ``load`` runs it once and reads its result from then on
(:func:`fold_recipes`): the same op on the same tensors, so the loaded model computes what
the lowered one did. The file stays data: a recipe is an op of this library with tensor and
number arguments, like every other node of the graph (a plain ``torch.export.load`` runs it
on every call instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from quantree.backends.cpu.native.packing import pack, row_sums
from quantree.backends.cpu.saved.derived_ops import RECIPE_OPS
from quantree.backends.cpu.saved.notes import note, notes
from quantree.backends.patterns import constant
from quantree.core.errors import QuantreeError
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext
from quantree.core.stages import DEQUANTIZED_GROUP_KEY, FOLDED_FROM_KEY, GROUPS_KEY

RECIPE_KEY = "quantree_recipe"
"""``node.meta`` key on a lowered constant's ``get_attr``: the :class:`Recipe` giving it."""
RECIPE_NOTE = "quantree_recipe"
"""What ``core.annotations`` records about a constant: the :class:`Recipe` giving it."""


@dataclass(frozen=True)
class Recipe:
    """``op(*args)``: the args are tensors every call site shares, numbers, strings, None,
    and other recipes (a requantization from a derived scale), computed first."""

    op: Any
    args: tuple[Any, ...]

    def compute(self) -> Tensor:
        args = [a.compute() if isinstance(a, Recipe) else a for a in self.args]
        value: Tensor = self.op(*args)
        return value


def remember(value: Tensor, recipe: Recipe | None) -> bool:
    """Record ``recipe`` on ``value`` if it gives ``value`` bit for bit (else nothing)."""
    if recipe is None:
        return False
    try:
        derived = recipe.compute()
    except QuantreeError:  # arguments the op does not take: the constant is saved as it is
        return False
    if not _same(derived, value):
        return False
    note(value, RECIPE_NOTE, recipe)
    return True


def recipe_of(value: object) -> Recipe | None:
    """The recipe recorded on a constant tensor, if any."""
    recipe = notes(value).get(RECIPE_NOTE)
    return recipe if isinstance(recipe, Recipe) else None


def summed(values: Tensor, packed: Tensor, groups: int = 1) -> Tensor:
    """``row_sums(values)``, recorded as derived from ``packed``, the weight as the kernels
    hold it (which the file holds anyway): 4 bytes per output channel less on disk, a third
    of what a depthwise 3 x 3 channel's nine weights weigh."""
    sums = row_sums(values)
    rows = int(values.shape[0])
    remember(sums, Recipe(torch.ops.quantree.derived_row_sums.default, (packed, rows, groups)))
    return sums


def packed_and_sums(values: Tensor) -> list[Tensor]:
    """``[pack(values), row sums]``, the sums recorded as derived from the packed weight."""
    packed = pack(values)
    return [packed, summed(values, packed)]


@dataclass(frozen=True)
class BiasSource:
    """What an int32 bias was rounded from: float bias, weight scales, input scale."""

    bias: Tensor
    weight_scale: Tensor
    input_scale: float


def bias_source(ctx: LoweringContext, bias_arg: object) -> BiasSource | None:
    """Where ``convert`` got the int32 bias ``bias_arg`` dequantizes; None when it was not
    folded from a float bias on the grid (per-tensor input) x (weight) scale."""
    dq = ctx.dequantized(bias_arg)
    if dq is None or not dq.is_constant:
        return None
    bias = dq.source.meta.get(FOLDED_FROM_KEY)
    groups = ctx.gm.meta.get(GROUPS_KEY) or {}
    group = groups.get(dq.node.meta.get(DEQUANTIZED_GROUP_KEY))
    if not isinstance(bias, Tensor) or group is None or len(group.derived_from) != 2:
        return None
    sources = [groups.get(gid) for gid in group.derived_from]
    if any(s is None or s.qparams is None for s in sources):
        return None
    input_params, weight_params = (s.qparams for s in sources)  # type: ignore[union-attr]
    if input_params.scale.numel() != 1:
        return None
    scale = float(input_params.scale.reshape(-1)[0])
    return BiasSource(bias.detach().reshape(-1), weight_params.scale.detach(), scale)


def bias_recipe(ctx: LoweringContext, bias_arg: object) -> Recipe | None:
    """The recipe of the float bias a kernel adds (the int32 bias, dequantized), if any."""
    source = bias_source(ctx, bias_arg)
    if source is None:
        return None
    args = (source.bias, source.weight_scale, source.input_scale)
    return Recipe(torch.ops.quantree.derived_bias.default, args)


def derived_constant(
    ctx: LoweringContext, prefix: str, value: Tensor, before: fx.Node, recipe: Recipe | None
) -> fx.Node:
    """``constant(...)`` that records ``recipe`` when it computes ``value`` bit for bit."""
    node = constant(ctx, prefix, value, before)
    if remember(fetch_attr(ctx.gm, str(node.target)), recipe):
        node.meta[RECIPE_KEY] = recipe
    return node


def _same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def fold_recipes(gm: fx.GraphModule) -> int:
    """Run each recipe of a loaded graph once and read its result from then on.

    Raises ``QuantreeError`` naming the node for a recipe whose arguments are not constants
    of the file or do not fit together (a file quantree did not write).
    """
    folded = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in RECIPE_OPS:
            continue
        args: list[Any] = []
        kwargs = dict(node.kwargs)
        if any(isinstance(v, fx.Node) for v in kwargs.values()):
            raise QuantreeError(
                f"node {node.name} ({node.target}) passes a tensor by keyword; the file was "
                "not written by quantree.backends.save (re-save the lowered model)"
            )
        for arg in node.args:
            if isinstance(arg, fx.Node):
                if arg.op != "get_attr":
                    raise QuantreeError(
                        f"node {node.name} ({node.target}) derives a constant from "
                        f"{arg.name}, which is not a constant of the file; the file was not "
                        "written by quantree.backends.save (re-save the lowered model)"
                    )
                arg = fetch_attr(gm, str(arg.target))
            args.append(arg)
        try:
            value = node.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, ArithmeticError) as error:
            raise QuantreeError(
                f"node {node.name} ({node.target}) cannot derive its constant: "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
            ) from None
        name = f"_derived_{folded}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, value)
        with graph.inserting_before(node):
            read = graph.get_attr(name)
        read.meta["val"] = value
        node.replace_all_uses_with(read)
        graph.erase_node(node)
        folded += 1
    if folded:
        for node in list(graph.nodes):  # the recipes' inputs, read by nothing now
            if node.op == "get_attr" and not node.users:
                graph.erase_node(node)
        gm.recompile()
    return folded
