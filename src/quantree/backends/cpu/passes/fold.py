"""Tensors no input reaches, computed once at lowering instead of on every call.

torchaudio's Emformer builds its attention mask from scratch on every forward: about eighty
``zeros`` / ``ones`` / ``cat`` ops, an ``rsub`` and a ``to(bool)`` on shapes fixed by the
segment length, and three empty memory tensors. Lowered, each is a dispatcher call of a few
microseconds whose result never changes (rnnt: 90 of the ~220 top-level nodes). This pass
evaluates every deterministic, non-mutating op that reads no input and stores the result as
a constant; the graph computes what it computed before, bit for bit.

``core.fold.fold_constants`` folds parameter-only computations before calibration; it leaves
ops with no input at all (``zeros``) alone, since a constant there would be observed and
quantized like a weight. After lowering nothing is observed any more, so they fold too.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.utils import _pytree as pytree

from quantree.core.graphs import attr_at, register_constant
from quantree.core.normalizing.fold import known_values, run_on

aten = torch.ops.aten

MAX_ELEMENTS = 1 << 16
"""Larger results keep being computed: a folded tensor is stored in the model (and its file)."""


GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
"""Export's wrapper of a ``torch.no_grad()`` block (Hugging Face's rotary embedding computes
its ``cos``/``sin`` tables in one): a call of a nested graph, folded when that graph is pure
and every tensor it reads is known."""


def _pure_op(target: object) -> bool:
    """An aten op that neither writes memory nor draws random numbers, or one of quantree's
    lowered ops (pure functions of their arguments)."""
    if str(target).startswith("quantree."):
        return True
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _owner(node: fx.Node) -> torch.nn.Module:
    owner = node.graph.owning_module
    assert owner is not None
    return owner


def _pure_region(node: fx.Node, known: dict[fx.Node, object]) -> bool:
    """A ``wrap_with_set_grad_enabled`` call of a pure nested graph on ``known`` tensors."""
    a = node.args
    if node.target is not GRAD_REGION or len(a) < 2 or not isinstance(a[1], fx.Node):
        return False
    body = attr_at(_owner(node), str(a[1].target))
    if not isinstance(body, fx.GraphModule) or any(
        x not in known for x in node.all_input_nodes if x is not a[1]
    ):
        return False
    return all(
        n.op in ("placeholder", "output", "get_attr")
        or (n.op == "call_function" and (n.target is operator.getitem or _pure_op(n.target)))
        for n in body.graph.nodes
    )


def _deterministic(node: fx.Node, known: dict[fx.Node, object]) -> bool:
    """Whether ``node`` is a pure op on ``known`` values (or on none: a ``zeros``)."""
    if _pure_region(node, known):
        return True
    if node.op != "call_function" or not all(n in known for n in node.all_input_nodes):
        return False
    if node.target is operator.getitem:
        return bool(node.all_input_nodes)
    return _pure_op(node.target)


def _uninitialized(node: fx.Node) -> bool:
    return isinstance(node.target, OpOverload) and node.target.__name__.startswith("empty")


def _static(value: object) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape)


def _value(node: fx.Node, known: dict[fx.Node, object]) -> object:
    """``node``'s value when no input reaches it and it is worth storing, else None."""
    if not _deterministic(node, known):
        return None
    fake = pytree.tree_leaves(node.meta.get("val"))
    if any(isinstance(v, torch.Tensor) and not _static(v) for v in fake):
        return None  # a symbolic shape: depends on an input after all
    if node.target is GRAD_REGION:
        a = node.args
        body = attr_at(_owner(node), str(a[1].target))  # type: ignore[union-attr]
        args = [known[x] if isinstance(x, fx.Node) else x for x in a[2:]]
        with torch.no_grad():
            value = node.target(a[0], body, *args)
    else:
        value = run_on(node, known)
    if isinstance(value, torch.Tensor) and value.numel() > MAX_ELEMENTS:
        return None
    if _uninitialized(node) and not (isinstance(value, torch.Tensor) and not value.numel()):
        return None  # its contents are whatever memory held: only an empty one is known
    return value


def _functional_twin(node: fx.Node) -> OpOverload | None:
    """The out-of-place overload of an in-place aten op (``add_.Tensor``: ``add.Tensor``)."""
    target = node.target
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    twin = getattr(getattr(aten, name[:-1], None), target._overloadname, None)
    return twin if isinstance(twin, OpOverload) and not twin._schema.is_mutable else None


def _fresh(node: object) -> bool:
    """A tensor an aten op made anew (no view of another) that only one op reads."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or len(node.users) != 1:
        return False
    target = node.target
    if not isinstance(target, OpOverload) or target._schema.is_mutable:
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None


def functionalize_temporaries(gm: fx.GraphModule) -> int:
    """Write each in-place op on a temporary nothing else reads out of place; returns how many.

    T5 builds its relative position buckets with ``add_`` on a tensor it just made: the graph
    writes to it, so it could not be folded though no input reaches it. Out of place it
    computes the same values (the dtypes and shape checked equal, so no promotion or
    broadcast differs) and nothing else saw the write.
    """
    changed = 0
    for node in gm.graph.nodes:
        twin = _functional_twin(node)
        a = node.args
        if twin is None or not a or not _fresh(a[0]) or a[0] in a[1:] or node.kwargs:
            continue
        val, src = node.meta.get("val"), a[0].meta.get("val")  # type: ignore[union-attr]
        tensors = [x.meta.get("val") for x in a[1:] if isinstance(x, fx.Node)]
        if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
            continue
        if any(not isinstance(t, torch.Tensor) or t.dtype != src.dtype for t in tensors):
            continue
        if val.shape != src.shape or any(t.dim() > src.dim() for t in tensors):  # type: ignore[union-attr]
            continue
        node.target = twin
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def fold_input_independent(gm: fx.GraphModule) -> int:
    """Replace each tensor no graph input reaches by a constant, in place; returns how many.

    A tensor made by one op from nothing (a ``zeros`` read directly) stays: a constant saves
    no call there. ``_assert_tensor_metadata`` checks on folded values ran here once and go.
    """
    graph = gm.graph
    functionalize_temporaries(gm)
    known = known_values(gm, _value)
    folded = 0
    for node, value in known.items():
        if node.op == "get_attr":
            continue
        if node.target == torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
            continue
        if not isinstance(value, torch.Tensor) or not any(n in known for n in node.all_input_nodes):
            continue
        if all(user in known for user in node.users) or any(u.op == "output" for u in node.users):
            continue  # (a result handed to the caller stays fresh: they may write to it)
        with graph.inserting_before(node):
            constant = graph.get_attr(register_constant(gm, "_cpu_folded_", value.detach()))
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        folded += 1
    if folded:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return folded
