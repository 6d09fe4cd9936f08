"""Backends: values that say how a reference q/dq graph becomes real kernels.

A backend is an ordered tuple of lowering rules plus optional quantize/dequantize functions
for tensor types of its own. There is no global table: two backends never interfere, and
``a + b`` tries the rules of ``b`` first. A rule is a function ``(ctx, node) -> bool`` that
looks at one anchor node and, if its q/dq-sandwiched pattern is there, rewrites it and
returns True. ``LoweringContext`` gives rules what they need without touching quantree's
internals: the dequantized inputs of a node, its quantized output, each node's annotation
and module scope, and the backend's quantize function.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.graphs import copy_graph_module, fetch_attr, register_constant
from quantree.core.grouping.sharing import Group
from quantree.core.qdq import (
    DEQUANTIZE_OPS,
    QUANTIZE_OPS,
    dequantize_tensor,
    params_of,
    quantize_tensor,
)
from quantree.core.specs import QParams
from quantree.core.stages import CONVERTED, GROUPS_KEY, NodeQuant, node_quant, require_stage
from quantree.core.values import module_scope


@dataclass(frozen=True)
class Dequantized:
    """An input read through ``dequantize``: the integer node and its parameters."""

    node: fx.Node  # the dequantize node
    source: fx.Node  # what it dequantizes (a quantize node or an integer constant)
    params: QParams

    @property
    def is_constant(self) -> bool:
        return self.source.op == "get_attr"


@dataclass(frozen=True)
class Quantized:
    """An output written through ``quantize``: the quantize node and its parameters."""

    node: fx.Node
    params: QParams


class LoweringContext:
    """What a lowering rule may read and do; one per ``lower`` call."""

    def __init__(self, gm: fx.GraphModule, backend: Backend) -> None:
        self.gm = gm
        self.backend = backend
        self.groups: dict[int, Group] = gm.meta.get(GROUPS_KEY, {})

    def dequantized(self, arg: object) -> Dequantized | None:
        """``arg`` if it is the output of a dequantize, with its integer source."""
        if not isinstance(arg, fx.Node) or arg.target not in DEQUANTIZE_OPS:
            return None
        source = arg.args[0]
        assert isinstance(source, fx.Node)
        return Dequantized(arg, source, params_of(arg, self.gm))

    def quantized_output(self, node: fx.Node) -> Quantized | None:
        """The single quantize that reads ``node``, if that is its only user."""
        users = list(node.users)
        if len(users) != 1 or users[0].target not in QUANTIZE_OPS:
            return None
        return Quantized(users[0], params_of(users[0], self.gm))

    def annotation(self, node: fx.Node) -> NodeQuant | None:
        """What prepare decided for ``node``: its Annotation and its groups' ids."""
        return node_quant(node)

    def group_params(self, gid: int) -> QParams | None:
        group = self.groups.get(gid)
        return None if group is None else group.qparams

    def for_backend(self, backend: Backend) -> LoweringContext:
        """The same lowering seen by one part of a composed backend (its tensor functions)."""
        view = copy.copy(self)
        view.backend = backend
        return view

    def scope(self, node: fx.Node) -> str:
        """The fully qualified name of the module ``node`` came from."""
        return module_scope(node)

    def constant(self, dq: Dequantized) -> torch.Tensor:
        """The float value of a folded constant (a weight), as the reference graph sees it."""
        if not dq.is_constant:
            raise QuantreeError(f"{dq.node.name} does not dequantize a constant")
        stored = fetch_attr(self.gm, str(dq.source.target))
        return self.dequantize(stored, dq.params)

    def quantize(self, x: torch.Tensor, params: QParams) -> torch.Tensor:
        """``x`` quantized the way this backend stores tensors (its own type, if it has one)."""
        if self.backend.quantize is not None:
            return self.backend.quantize(x, params)
        return quantize_tensor(x, params)

    def dequantize(self, q: torch.Tensor, params: QParams) -> torch.Tensor:
        if self.backend.dequantize is not None:
            return self.backend.dequantize(q, params)
        return dequantize_tensor(q, params)

    def add_constant(self, prefix: str, value: torch.Tensor | object, before: fx.Node) -> fx.Node:
        """Store ``value`` on the module and return a ``get_attr`` node placed before ``before``.

        Tensors become buffers; anything else (a packed-weight object) a plain attribute.
        """
        if isinstance(value, torch.Tensor):
            name = register_constant(self.gm, prefix, value)
        else:
            i = 0
            while hasattr(self.gm, f"{prefix}{i}"):
                i += 1
            name = f"{prefix}{i}"
            setattr(self.gm, name, value)
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.get_attr(name)


LoweringRule = Callable[[LoweringContext, fx.Node], bool]


@dataclass(frozen=True)
class Backend:
    """An ordered set of lowering rules; earlier rules are tried first at each node."""

    name: str
    rules: tuple[LoweringRule, ...] = ()
    quantize: Callable[[torch.Tensor, QParams], torch.Tensor] | None = None
    dequantize: Callable[[torch.Tensor, QParams], torch.Tensor] | None = None
    prepare_module: Callable[[fx.GraphModule], fx.GraphModule] | None = None

    def own_rules(self) -> tuple[LoweringRule, ...]:
        """The rules, bound to this backend's quantize/dequantize when it has its own."""
        if self.quantize is None and self.dequantize is None:
            return self.rules
        return tuple(functools.partial(_with_functions_of, self, rule) for rule in self.rules)

    def __add__(self, other: Backend) -> Backend:
        """``other``'s rules first, then ours; ``other``'s tensor functions if it has them;
        both module finishers, ours first. Each side's rules keep quantizing into that side's
        own tensor types."""
        finishers = [f for f in (self.prepare_module, other.prepare_module) if f is not None]
        return Backend(
            f"{self.name}+{other.name}",
            other.own_rules() + self.own_rules(),
            other.quantize or self.quantize,
            other.dequantize or self.dequantize,
            _chain(finishers) if len(finishers) > 1 else next(iter(finishers), None),
        )


def _with_functions_of(
    backend: Backend, rule: LoweringRule, ctx: LoweringContext, node: fx.Node
) -> bool:
    return rule(ctx.for_backend(backend), node)


def _chain(
    finishers: list[Callable[[fx.GraphModule], fx.GraphModule]],
) -> Callable[[fx.GraphModule], fx.GraphModule]:
    def run_all(gm: fx.GraphModule) -> fx.GraphModule:
        for finish in finishers:
            gm = finish(gm)
        return gm

    return run_all


REFERENCE = Backend("reference")
"""Leaves the quantize/dequantize graph exactly as convert made it."""


def lower(ref: fx.GraphModule, backend: Backend = REFERENCE) -> fx.GraphModule:
    """Apply ``backend``'s rules to a converted graph; ``ref`` itself is not changed."""
    if not isinstance(ref, fx.GraphModule):
        raise QuantreeError(
            f"lower expects the GraphModule quantree.convert returns, got a {type(ref).__name__}"
        )
    if not isinstance(backend, Backend):
        raise QuantreeError(
            f"lower's backend must be a Backend (quantree.REFERENCE, quantree.backends.CPU), got "
            f"{type(backend).__name__}; quantree.lower and quantree.quantize "
            "also take the names 'reference' and 'cpu'"
        )
    require_stage(
        ref, CONVERTED, "lower", "the output of quantree.convert", "calibrate and convert it first"
    )
    if not backend.rules and backend.prepare_module is None:
        return ref
    gm = copy_graph_module(ref)
    ctx = LoweringContext(gm, backend)
    live = set(gm.graph.nodes)
    for node in list(gm.graph.nodes):
        if node not in live or node.op == "output":
            continue  # erased by an earlier rewrite
        if any(rule(ctx, node) for rule in backend.rules):
            live = set(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    if backend.prepare_module is not None:
        gm = backend.prepare_module(gm)
    return gm
