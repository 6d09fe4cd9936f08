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

from quantree.core.errors import QuantreeError
from quantree.core.points import POINT_KEY, Point
from quantree.core.values import module_scope

Target = OpOverload | OpOverloadPacket | Point | Callable[..., Any]
Decompose = Callable[[fx.GraphModule, fx.Node], None]


@dataclass(frozen=True)
class Annotation:
    """How one node is quantized.

    ``outputs`` is a pytree of specs (or None) shaped like the node's output; a single-tensor
    output takes a bare spec. ``inputs`` maps argument paths (``(0,)``, ``(1, 0)`` for the
    ``h0`` inside ``[h0, c0]``) to specs. With ``share_with_producers`` an input whose spec asks
    for the producing Value's integer grid shares its parameters (no requantization), unless
    that would pull another Value onto a fixed grid.
    ``name`` labels the node's quantization points in reports and errors. ``decompose``
    asks prepare to replace the node by other nodes before anything is observed: it is
    called as ``decompose(gm, node)`` on prepare's private copy of the graph and rewrites it
    in place (cells mode's recurrent rule carries one); the nodes it adds, and the graphs
    nested in modules it adds, are then annotated like any other.
    """

    outputs: Any = None
    inputs: Mapping[tuple[Any, ...], Any] = field(default_factory=dict)
    share_with_producers: bool = True
    name: str | None = None
    decompose: Decompose | None = None


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

    def __post_init__(self) -> None:
        """Checked here because a wrong target (an op's name as a string) matches nothing:
        the rule would do nothing, silently. One target alone is taken as a 1-tuple."""
        targets: Any = self.targets
        if isinstance(targets, (OpOverload, OpOverloadPacket, Point, str)) or (
            callable(targets) and not isinstance(targets, (tuple, list))
        ):
            targets = (targets,)
        if not isinstance(targets, (tuple, list)) or not targets:
            raise QuantreeError(
                f"Rule targets must be a tuple of ops, got {targets!r}; e.g. "
                "Rule((torch.ops.aten.mul.Tensor,), annotate)"
            )
        for target in targets:
            if isinstance(target, str):
                raise QuantreeError(
                    f"Rule target {target!r} is a string, which matches no node: give the op, "
                    f"e.g. torch.ops.aten.{target} (every overload) or "
                    f"torch.ops.aten.{target}.<overload>, or qt.Point({target!r}) for a named "
                    "point"
                )
            if not (isinstance(target, (OpOverload, OpOverloadPacket, Point)) or callable(target)):
                raise QuantreeError(
                    f"Rule target {target!r} is a {type(target).__name__}, not an op: give "
                    "an OpOverload, its packet, a qt.Point or a callable the graph calls"
                )
        object.__setattr__(self, "targets", tuple(targets))
        if not callable(self.annotate):
            raise QuantreeError(
                f"Rule annotate must be a function of a node, got {type(self.annotate).__name__}"
            )
        if self.scope is not None and not isinstance(self.scope, str):
            raise QuantreeError(
                f"Rule scope must be a module's qualified name (a str), got {self.scope!r}"
            )

    def matches(self, node: fx.Node) -> bool:
        if not self.matches_target(node):
            return False
        return self.scope is None or in_scope(module_scope(node), self.scope)

    def matches_target(self, node: fx.Node) -> bool:
        """Whether ``node`` is one of ``targets``, wherever it is (``scope`` not applied)."""
        point = node.meta.get(POINT_KEY)
        points = (t.name for t in self.targets if isinstance(t, Point))
        if point is not None and point in points:
            return True
        if node.op != "call_function":
            return False
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        return any(t is target or (packet is not None and t is packet) for t in self.targets)


def in_scope(scope: str, within: str) -> bool:
    """Whether module scope ``scope`` is ``within`` or one of its submodules."""
    return scope == within or scope.startswith(within + ".")


@dataclass(frozen=True)
class IdleScope:
    """A ``Rule.scope`` under which none of the rules that name it matched a node.

    ``present`` are those rules whose targets occur elsewhere, in the scopes ``found_in``
    (both empty when the targets occur nowhere); ``rules`` are all the rules of the scope.
    """

    scope: str
    rules: tuple[Rule, ...]
    present: tuple[Rule, ...]
    found_in: tuple[str, ...]
    scopes: tuple[str, ...]

    @property
    def message(self) -> str:
        """What did nothing, and where its ops are (or which scopes the model has)."""
        shown = self.present or self.rules
        targets = list(dict.fromkeys(_target_name(t) for rule in shown[:3] for t in rule.targets))
        others = len(self.rules) - min(len(shown), 3)
        more = f" (and {others} other rule(s) of that scope)" if others else ""
        if self.found_in:
            where = f"these ops occur in scopes {_quoted(self.found_in)}"
        else:
            where = f"the model's module scopes are {_quoted(self.scopes)}"
        return (
            f"quantree: no node in scope {self.scope!r} matched the rule(s) for "
            f"{', '.join(targets[:8])}{more}, so they did nothing; {where}. A scope is the "
            "fully qualified name of a module (as in model.named_modules()); check its spelling"
        )


def _target_name(target: Target) -> str:
    return f"Point({target.name!r})" if isinstance(target, Point) else str(target)


def _quoted(scopes: Iterable[str]) -> str:
    named = [repr(s) for s in scopes if s]
    if not named:
        return "(none)"
    return ", ".join(named[:20]) + (" ..." if len(named) > 20 else "")


def idle_scopes(rules: Iterable[Rule], nodes: Iterable[fx.Node]) -> list[IdleScope]:
    """Scopes of ``rules`` that matched none of ``nodes``, when that looks like a mistake.

    Rules are taken together by scope: a recipe limited to one module (``cells_scope``)
    brings rules for ops that module may lack (GRU gates on an LSTM), which is not an error
    as long as some rule of that scope applies. A scope with no match is reported when its
    rules' targets occur elsewhere (a misspelt or wrong module) or when no node lies in it
    at all; rules for ops the model does not have, under a module it does have, are not.
    """
    nodes = list(nodes)
    scopes = tuple(sorted({module_scope(n) for n in nodes}))
    by_scope: dict[str, list[Rule]] = {}
    for rule in rules:
        if rule.scope is not None:
            by_scope.setdefault(rule.scope, []).append(rule)
    idle = []
    for scope, scoped in by_scope.items():
        if any(rule.matches(node) for rule in scoped for node in nodes):
            continue
        hits = {r: [n for n in nodes if r.matches_target(n)] for r in scoped}
        present = tuple(r for r in scoped if hits[r])
        found = sorted({module_scope(n) for r in present for n in hits[r]})
        if present or not any(in_scope(s, scope) for s in scopes):
            idle.append(IdleScope(scope, tuple(scoped), present, tuple(found), scopes))
    return idle


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

    def bind(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, Quantizer]:
        """The graph ``prepare`` annotates and the quantizer that annotates it: ``gm`` and this
        one as they are. A quantizer standing for another toolchain's (``recipes.pt2e``)
        runs that toolchain on ``gm`` here, so the core never needs to know it."""
        return gm, self

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
