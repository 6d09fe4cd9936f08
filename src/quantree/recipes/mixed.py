"""Mixed precision: a quantizer that widens chosen points of another to int16 or float.

A point is a node the base quantizer annotates, with the Value it outputs; it is named by
its module scope and node name (``PointKey``), which survive prepare's copy of the graph,
so the same choices reach the same nodes on every prepare. Widening a point to int16 takes
the wide quantizer's annotation for that node (A16W8's by default: int16 activations, the
weights kept int8 per channel) and the wide spec for every input that reads it: were its
readers to keep their int8 input spec, they would requantize it to int8 and undo the
widening (an outlier's range would bury the rest again at the next op). Leaving a point
float drops its annotation (the op runs float on dequantized inputs) and quantized readers
read its value at int16 (``READ_FLOAT``); the backends keep float ops float with their
usual warning. Every spec a widened point gets is one a recipe already makes, so lowering,
saving and export need nothing new. The search that decides which points to widen lives in
``quantree.tools.mixed_precision``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.quantizer import Annotation, Quantizer
from quantree.core.specs import QDtype, QuantSpec, SharedSpec
from quantree.core.values import arg_at, module_scope

READ_FLOAT = QuantSpec(QDtype.INT16, symmetric=True)
"""How a quantized op reads a point left float: at int16, so next to float, and on a grid
of its own (a max-pool's output shares its input's, a linear's bias derives from it)."""


class Precision(enum.Enum):
    """What a widened point becomes."""

    INT16 = "int16"
    FLOAT = "float"


@dataclass(frozen=True, order=True)
class PointKey:
    """One quantization point: the node ``name`` produced inside module ``scope``.

    Nodes of two nested graphs (cell bodies) with the same scope and name are one point;
    a recurrent layer's own node is a point too, which at int16 takes the wide recipe's
    annotation for the whole layer (A16W8's cells mode: int16 gates and cell state).
    """

    scope: str
    name: str

    def __str__(self) -> str:
        return f"{self.scope}/{self.name}" if self.scope else self.name


def point_key(node: fx.Node) -> PointKey:
    return PointKey(module_scope(node), node.name)


class MixedQuantizer(Quantizer):
    """``base``'s annotations, except at the points ``choices`` widens.

    With ``record`` the keys of every node ``base`` annotates are appended to it, in the
    order prepare asks (graph order, nested graphs after the node that makes them): how
    the search lists the points it may widen.
    """

    __slots__ = ("base", "choices", "record", "wide")

    def __init__(
        self,
        base: Quantizer,
        wide: Quantizer,
        choices: Mapping[PointKey, Precision],
        record: list[PointKey] | None = None,
    ) -> None:
        super().__init__(base.rules)
        for key, precision in choices.items():
            if not isinstance(key, PointKey) or not isinstance(precision, Precision):
                raise QuantreeError(
                    f"mixed precision choices map a PointKey to a Precision, got {key!r}: "
                    f"{precision!r}"
                )
        self.base = base
        self.wide = wide
        self.choices = dict(choices)
        self.record = record

    def bind(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, Quantizer]:
        gm, base = self.base.bind(gm)
        gm, wide = self.wide.bind(gm)
        return gm, MixedQuantizer(base, wide, self.choices, self.record)

    def annotate_node(self, node: fx.Node) -> Annotation | None:
        annotation = self.base.annotate_node(node)
        if annotation is None:
            return None
        key = point_key(node)
        if self.record is not None and key not in self.record:
            self.record.append(key)
        precision = self.choices.get(key)
        if precision is Precision.FLOAT:
            return None
        wide = self.wide.annotate_node(node) if self.choices else None
        if precision is Precision.INT16 and wide is not None:
            annotation = wide  # the wide recipe's annotation whole: consistent in itself
        inputs = dict(annotation.inputs)
        for path, spec in annotation.inputs.items():
            producer = _producer(node, path)
            source = self.choices.get(producer) if producer is not None else None
            if source is Precision.INT16 and wide is not None and isinstance(spec, QuantSpec):
                wider = wide.inputs.get(path)
                if isinstance(wider, QuantSpec):  # read at the wide grid, not requantized
                    inputs[path] = wider
            elif source is Precision.FLOAT and isinstance(spec, QuantSpec | SharedSpec):
                inputs[path] = READ_FLOAT
        return replace(annotation, inputs=inputs)

    def __repr__(self) -> str:
        return f"MixedQuantizer({self.base!r}, {len(self.choices)} widened)"


def _producer(node: fx.Node, path: tuple[Any, ...]) -> PointKey | None:
    try:
        arg = arg_at(node, path)
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return point_key(arg) if isinstance(arg, fx.Node) else None
