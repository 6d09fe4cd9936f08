"""Quantizers: values built from rules (op pattern -> annotation), composed with ``+``.

A rule sees one node and returns an Annotation or None. Nothing here touches module-level
state: two quantizers never interfere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch._ops import OpOverload, OpOverloadPacket

from quantree.points import POINT_KEY, CellsOptions, Point
from quantree.values import module_scope

Target = OpOverload | OpOverloadPacket | Point | Callable[..., Any]


@dataclass(frozen=True)
class Annotation:
    """How one node is quantized.

    ``outputs`` is a pytree of specs (or None) shaped like the node's output; a single-tensor
    output takes a bare spec. ``inputs`` maps argument paths (``(0,)``, ``(1, 0)`` for the
    ``h0`` inside ``[h0, c0]``) to specs. With ``share_with_producers`` an input whose spec asks
    for the producing Value's integer grid shares its parameters (no requantization), unless
    that would pull another Value onto a fixed grid.
    ``name`` labels the node's quantization points in reports and errors. ``cells``, on a
    recurrent node, asks prepare to decompose it into cell loops (see ``quantree.cells``).
    """

    outputs: Any = None
    inputs: Mapping[tuple[Any, ...], Any] = field(default_factory=dict)
    share_with_producers: bool = True
    name: str | None = None
    cells: CellsOptions | None = None


AnnotateFn = Callable[[fx.Node], Annotation | None]


@dataclass(frozen=True)
class Rule:
    """Annotate nodes calling one of ``targets`` (an OpOverload, its packet, or a callable).

    ``scope``, when given, restricts the rule to nodes produced inside that module (its fully
    qualified name, e.g. ``"encoder.lstm"``) or any of its submodules.
    """

    targets: tuple[Target, ...]
    annotate: AnnotateFn
    scope: str | None = None

    def matches(self, node: fx.Node) -> bool:
        point = node.meta.get(POINT_KEY)
        by_point = point is not None and any(
            isinstance(t, Point) and t.name == point for t in self.targets
        )
        if not by_point:
            if node.op != "call_function":
                return False
            target = node.target
            packet = getattr(target, "overloadpacket", None)
            if not any(t is target or (packet is not None and t is packet) for t in self.targets):
                return False
        if self.scope is None:
            return True
        scope = module_scope(node)
        return scope == self.scope or scope.startswith(self.scope + ".")


class Quantizer:
    """An ordered collection of rules. In ``a + b`` the rules of ``b`` take precedence."""

    __slots__ = ("_rules",)

    def __init__(self, rules: Iterable[Rule] = ()) -> None:
        self._rules: tuple[Rule, ...] = tuple(rules)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self._rules

    def __add__(self, other: Quantizer) -> Quantizer:
        return Quantizer(self._rules + other.rules)

    def annotate_node(self, node: fx.Node) -> Annotation | None:
        """The annotation of the last rule that matches ``node`` and returns one."""
        for rule in reversed(self._rules):
            if rule.matches(node):
                annotation = rule.annotate(node)
                if annotation is not None:
                    return annotation
        return None

    def annotate(self, gm: fx.GraphModule) -> dict[fx.Node, Annotation]:
        """The annotation of every node some rule claims."""
        result: dict[fx.Node, Annotation] = {}
        for node in gm.graph.nodes:
            annotation = self.annotate_node(node)
            if annotation is not None:
                result[node] = annotation
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._rules)} rules)"
