"""The graph-metadata contract: what each pass leaves on a graph for the passes after it.

``prepare`` marks a graph ``prepared`` and records, per node, what it decided; ``convert``
marks it ``converted`` and keeps the group table with calibrated parameters; ``lower``,
backends and tools read those marks. Keeping the keys here, and nowhere else, means no pass
imports another just to read what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.quantizer import Annotation
from quantree.core.values import Path

if TYPE_CHECKING:
    from quantree.core.grouping.sharing import Group

STAGE_KEY = "quantree_stage"
TRAINED_KEY = "quantree_trained"
"""Set on a reference graph converted from a QAT model: it was trained against float
arithmetic between its points (a recurrent layer's state fed back in float), which a lowering
can choose to follow more closely than its fastest form does."""
"""``gm.meta`` key: :data:`PREPARED` or :data:`CONVERTED`, so each step refuses the wrong input."""
GROUPS_KEY = "quantree_groups"
"""``gm.meta`` key: ``dict[int, Group]``, the sharing groups (with parameters once converted)."""
NODE_KEY = "quantree"
"""``node.meta`` key: the :class:`NodeQuant` of an annotated node."""
OBSERVER_KEY = "quantree_observer"
"""``node.meta`` key on an observer call: the id of the group it observes."""
DEQUANTIZED_GROUP_KEY = "quantree_group"
"""``node.meta`` key on a dequantize convert inserted: the id of the group it reads."""

REPLACES_KEY = "quantree_replaces"
"""``node.meta`` key on a backend's kernel: ``(name, leaf path)`` of the reference-graph
Value its output holds, so tools compare a lowered model's kernels with the float model."""
FOLDED_FROM_KEY = "quantree_folded_from"
"""``node.meta`` key on the ``get_attr`` of a folded int32 constant (a derived bias): the
float tensor it quantizes. One float bias serves every call site of an unrolled layer, while
its int32 grid follows each call site's input scale, so a backend may store the float tensor
once and derive each call site's integers from it."""
VALUE_OF_KEY = "quantree_value_of"
"""``node.meta`` key on a node holding a Value of a node a pass removed: ``(name, leaf path)``
of that Value in the graph before the pass (the last layer's output of a stacked recurrent
call that prepare split into layers is ``(stacked call, (0,))``), so tools comparing with the
captured model still find the user's layer. Backends carry it onto the kernels they insert."""
OUTPUT_GRID_KEY = "quantree_output_grid"
"""``node.meta`` key on a kernel with an int8 output: its ``(scale, zero_point)``."""

PREPARED = "prepared"
CONVERTED = "converted"


@dataclass(frozen=True)
class NodeQuant:
    """What prepare decided for one annotated node (kept in ``node.meta['quantree']``)."""

    annotation: Annotation
    output_groups: dict[Path, int] = field(default_factory=dict)
    input_groups: dict[Path, int] = field(default_factory=dict)


def stage_of(gm: fx.GraphModule) -> str:
    """The stage mark of ``gm`` as text, for messages."""
    return str(gm.meta.get(STAGE_KEY, "captured or float"))


def require_stage(
    gm: fx.GraphModule, stage: str, step: str, expected: str, fix: str
) -> dict[int, Group]:
    """The group table of ``gm``, after checking that ``gm`` is at ``stage`` for ``step``."""
    groups: dict[int, Group] | None = gm.meta.get(GROUPS_KEY)
    if groups is None or gm.meta.get(STAGE_KEY) != stage:
        raise QuantreeError(f"{step} expects {expected}, got a {stage_of(gm)} model: {fix}")
    return groups


def node_quant(node: fx.Node) -> NodeQuant | None:
    """What prepare decided for ``node``, if it was annotated."""
    return node.meta.get(NODE_KEY)
