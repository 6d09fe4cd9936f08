"""Sink elementwise producers of a folded loop's per-step inputs into its step.

A selective scan written in PyTorch computes its per-step inputs whole before the loop
(``exp(A[:, None] * dt[..., None])``, ``dt[..., None] * B[:, None] * x[..., None]``: a ``[B,
D, T, N]`` tensor each) and the loop reads one ``[B, D, N]`` slice of them a step. Computed
whole, those tensors are written and read once more than the loop needs, which costs more
than the folded loop itself at a few hundred steps. Step ``t``'s slice of an elementwise op
is the op of its operands' slices (``select(f(a, b), d, t) = f(a_t, b_t)``, an operand
broadcast along ``d`` read whole), so the op moves into the step, which then reads the
smaller operands; repeated while the new per-step inputs are themselves such ops.

A producer moves only where nothing else reads it (its other readers would still need the
whole tensor), where it is elementwise along the step dimension (an op tagged ``pointwise``
that draws no random numbers, a dtype cast, an ``unsqueeze`` or a ``slice`` of another
dimension; a slice of the whole step dimension is its input) and where the step's op gives
the slice's shape and dtype exactly (a 0-d slice would promote types differently). The step
computes the same ops on the same elements, so the loop's results are those of the ops
computed whole (exactly for arithmetic; to the last bit of a vectorised ``exp`` and the
like).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

from quantree.core.graphs import fetch_attr, unique_attr
from quantree.core.points import POINT_KEY
from quantree.recurrent.unrolled.step_loop import StepInput, StepLoop

aten = torch.ops.aten
CASTS = (aten.to.dtype, aten._to_copy.default)
CAST_KWARGS = {"dtype"}
"""The only keyword a cast may carry to move into the step (not a device or layout)."""
VIEWS = (aten.unsqueeze.default, aten.slice.Tensor)
"""Views along one dimension (argument 1) that move into the step when it is not the step's."""
ASSERTS = (aten._assert_tensor_metadata.default,)
"""Export's dtype checks on a tensor: they read it, compute nothing, and go where it goes."""


@dataclass
class _Plan:
    """How source ``index`` moves into the step: ``leaves`` of the op's arguments, each
    ``("src", node, spec)``, ``("inv", node)``, ``("cut", node, dim)`` (an invariant read
    as its ``select(dim, 0)``) or ``("const", value)``."""

    index: int
    node: fx.Node
    leaves: list[tuple[Any, ...]]
    spec: Any
    args_fix: dict[int, Any] = field(default_factory=dict)  # leaf -> replaced constant
    val: Any = None


def sink_producers(gm: fx.GraphModule, name: str) -> int:
    """Move the elementwise producers only loop ``name`` (a ``StepLoop``) reads into its
    step, as long as one moves; how many moved. ``gm`` is left to be linted and recompiled."""
    loop = gm.get_submodule(name)
    assert isinstance(loop, StepLoop)
    call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == name)
    moved = 0
    while _sink_one(gm, call, loop):
        moved += 1
    return moved


def _sink_one(gm: fx.GraphModule, call: fx.Node, loop: StepLoop) -> bool:
    """Move one producer of ``loop``'s per-step inputs into its step (False: none moves)."""
    n, m = loop.n_states, len(loop.inputs)
    for i, src in enumerate(call.args[n : n + m]):
        assert isinstance(src, fx.Node)
        if _whole_slice(call, src):  # ``decay[:, :, t]``'s ``[:]``: read its input
            call.args = (*call.args[: n + i], src.args[0], *call.args[n + i + 1 :])
            _erase(gm, src)
            return True
        plan = _plan(call, i, src, loop.inputs[i])
        if plan is not None:
            _apply(gm, call, loop, plan)
            return True
    return False


def _only_the_loop_reads(call: fx.Node, src: fx.Node) -> bool:
    """Whether ``call`` reads ``src`` once, as a per-step input, and nothing else does."""
    if any(u is not call and u.target not in ASSERTS for u in src.users):
        return False
    return sum(a is src for a in call.args) == 1


def _whole_slice(call: fx.Node, src: fx.Node) -> bool:
    """Whether ``src`` is a slice of a whole dimension (the same tensor) only ``call`` reads."""
    if src.target != aten.slice.Tensor or src.kwargs or not isinstance(src.args[0], fx.Node):
        return False
    a: Any = src.args
    start, step = (a[2] if len(a) > 2 else 0), (a[4] if len(a) > 4 else 1)
    out, whole = src.meta.get("val"), a[0].meta.get("val")
    if start not in (0, None) or step != 1 or not isinstance(out, Tensor):
        return False
    return (
        isinstance(whole, Tensor)
        and list(out.shape) == list(whole.shape)
        and _only_the_loop_reads(call, src)
    )


def _erase(gm: fx.GraphModule, node: fx.Node) -> None:
    for user in list(node.users):
        gm.graph.erase_node(user)  # the asserts left: the loop no longer reads it
    gm.graph.erase_node(node)


def _plan(call: fx.Node, index: int, src: fx.Node, spec: StepInput) -> _Plan | None:
    if src.op != "call_function" or not _elementwise(src) or not _only_the_loop_reads(call, src):
        return None
    out = src.meta.get("val")
    if not isinstance(out, Tensor) or out.dim() == 0:
        return None
    r = out.dim()
    d = spec.dim % r
    steps = out.shape[d]
    if not isinstance(steps, int):
        return None
    leaves, _ = tree_flatten((src.args, src.kwargs))
    plan = _Plan(index, src, [], spec)
    if src.target in VIEWS:  # a view along another dimension: the slice's view
        k = src.args[1]
        assert isinstance(k, int)
        k %= r
        if k == d:
            return None
        a = src.args[0]
        assert isinstance(a, fx.Node)
        below = src.target == aten.unsqueeze.default and k < d  # the step's dimension moved
        plan.leaves = [("src", a, _moved(spec, d - 1 if below else d))]
        plan.leaves += [("const", x) for x in leaves[1:]]
        plan.args_fix[1] = k - 1 if spec.width == 0 and k > d else k
    else:
        for leaf in leaves:
            if not isinstance(leaf, fx.Node):
                plan.leaves.append(("const", leaf))
                continue
            val = leaf.meta.get("val")
            if not isinstance(val, Tensor):
                return None
            da = d - (r - val.dim())
            if da < 0:
                plan.leaves.append(("inv", leaf))
            elif val.shape[da] == 1 and steps != 1:
                plan.leaves.append(("inv", leaf) if spec.width else ("cut", leaf, da))
            elif isinstance(val.shape[da], int) and val.shape[da] == steps:
                plan.leaves.append(("src", leaf, _moved(spec, da)))
            else:
                return None
    plan.val = _step_val(src, plan)
    want = _cut(out, spec, d)
    if plan.val is None or want is None or plan.val.dtype != out.dtype:
        return None
    if list(plan.val.shape) != list(want.shape):
        return None
    if src.target not in VIEWS and _outer(src, plan) and not _static(plan.val):
        return None
    return plan


def _outer(src: fx.Node, plan: _Plan) -> bool:
    """Whether an operand of the op broadcasts to the result (an outer product)."""
    out = src.meta["val"]
    return any(
        isinstance(v := how[1].meta.get("val"), Tensor) and list(v.shape) != list(out.shape)
        for how in plan.leaves
        if how[0] != "const"
    )


def _static(val: Tensor) -> bool:
    """Whether every size of the step's value is fixed. A broadcast over a size left to vary
    (a dynamic batch) is one that programs do not run, and the loop would run in Python,
    slower than computing the op whole before it: such an op stays outside."""
    return all(isinstance(d, int) for d in val.shape)


def _elementwise(n: fx.Node) -> bool:
    target = n.target
    if target in VIEWS:
        a = n.args
        return not n.kwargs and isinstance(a[1], int) and all(type(x) in (int, type(None))
                                                              for x in a[1:])  # fmt: skip
    if target in CASTS:
        return set(n.kwargs) <= CAST_KWARGS
    tags = getattr(target, "tags", ())
    schema = getattr(target, "_schema", None)
    return (
        torch.Tag.pointwise in tags
        and torch.Tag.nondeterministic_seeded not in tags
        and schema is not None
        and not schema.is_mutable
        and len(schema.returns) == 1
    )


def _moved(spec: StepInput, dim: int) -> StepInput:
    return StepInput(dim, spec.start, spec.stride, spec.width)


def _index(size: int, spec: StepInput) -> int:
    """The first step's index along the step dimension (what the captured slice read)."""
    return spec.start if spec.stride > 0 else size - max(spec.width, 1) - spec.start


def _cut(val: Tensor, spec: StepInput, dim: int) -> Tensor | None:
    """The first step's slice of ``val`` (a fake tensor) along ``dim``."""
    mode = detect_fake_mode([val])
    if mode is None:
        return None
    size = val.shape[dim]
    if not isinstance(size, int):
        return None
    with mode:
        if spec.width == 0:
            return val.select(dim, _index(size, spec))
        return val.narrow(dim, _index(size, spec), spec.width)


def _step_val(src: fx.Node, plan: _Plan) -> Tensor | None:
    """The step's op run on the first step's operands (fake tensors): its shape and dtype."""
    leaves, tree = tree_flatten((src.args, src.kwargs))
    vals: list[Any] = []
    for p, (leaf, how) in enumerate(zip(leaves, plan.leaves, strict=True)):
        if how[0] == "const":
            vals.append(plan.args_fix.get(p, leaf))
        elif how[0] == "inv":
            vals.append(how[1].meta["val"])
        elif how[0] == "cut":
            vals.append(_cut(how[1].meta["val"], StepInput(how[2], 0, 1, 0), how[2]))
        else:
            vals.append(_cut(how[1].meta["val"], how[2], how[2].dim))
    if any(v is None for v, how in zip(vals, plan.leaves, strict=True) if how[0] != "const"):
        return None
    tensors = [v for v in vals if isinstance(v, Tensor)]
    mode = detect_fake_mode(tensors)
    if mode is None:
        return None
    args, kwargs = tree_unflatten(vals, tree)
    try:
        with mode:
            result = src.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # an op the fake tensors refuse at the step's shapes stays outside
        return None
    return result if isinstance(result, Tensor) else None


def _apply(gm: fx.GraphModule, call: fx.Node, loop: StepLoop, plan: _Plan) -> None:
    """Rewrite ``loop``'s body and ``call``'s arguments for ``plan``; erase the producer."""
    n, m = loop.n_states, len(loop.inputs)
    args: list[Any] = list(call.args)
    states, invariants = args[:n], args[n + m :]
    sources: list[tuple[fx.Node, StepInput]] = list(zip(args[n : n + m], loop.inputs, strict=True))
    del sources[plan.index]
    step_leaves: list[tuple[str, Any]] = []  # (src | inv | const | attr, position or value)
    for how in plan.leaves:
        if how[0] == "const":
            step_leaves.append(("const", how[1]))
        elif how[0] == "src":
            key = (how[1], how[2])
            if key not in sources:
                sources.append(key)
            step_leaves.append(("src", sources.index(key)))
        else:
            node = how[1]
            if how[0] == "cut":
                with gm.graph.inserting_before(call):
                    node = gm.graph.call_function(aten.select.int, (how[1], how[2], 0))
                node.meta = {"val": _cut(how[1].meta["val"], StepInput(how[2], 0, 1, 0), how[2])}
            elif node.op == "get_attr":  # a weight: the step's constant, as the fold makes it
                step_leaves.append(("attr", node))
                continue
            if node not in invariants:
                invariants.append(node)
            step_leaves.append(("inv", invariants.index(node)))
    loop.body = _body(gm, loop, plan, sources, invariants, step_leaves)
    loop.inputs = tuple(s for _, s in sources)
    call.args = (*states, *(a for a, _ in sources), *invariants)
    _erase(gm, plan.node)
    for how in plan.leaves:  # a weight only the producer read now lives in the step
        if how[0] == "inv" and how[1].op == "get_attr" and not how[1].users:
            gm.graph.erase_node(how[1])


def _body(
    gm: fx.GraphModule,
    loop: StepLoop,
    plan: _Plan,
    sources: list[tuple[fx.Node, StepInput]],
    invariants: list[Any],
    step_leaves: list[tuple[str, Any]],
) -> fx.GraphModule:
    """The step graph reading ``sources`` and ``invariants``, with the producer's op where
    its per-step input was."""
    old = loop.body
    placeholders = [p for p in old.graph.nodes if p.op == "placeholder"]
    n, m = loop.n_states, len(loop.inputs)
    old_states, old_sources = placeholders[:n], placeholders[n : n + m]
    old_invariants = placeholders[n + m :]
    kept_sources = old_sources[: plan.index] + old_sources[plan.index + 1 :]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    taken = {str(p.target) for p in placeholders}
    for p in old_states:
        env[p] = graph.placeholder(p.name)
        env[p].meta = copy.copy(p.meta)
    new_sources: list[fx.Node] = []
    for k, (node, spec) in enumerate(sources):
        if k < len(kept_sources):
            env[kept_sources[k]] = ph = graph.placeholder(kept_sources[k].name)
            ph.meta = copy.copy(kept_sources[k].meta)
        else:
            ph = graph.placeholder(_fresh(taken, "x", k))
            ph.meta = {"val": _cut(node.meta["val"], spec, spec.dim), POINT_KEY: ph.name}
            for key in ("nn_module_stack", "stack_trace"):
                if key in node.meta:
                    ph.meta[key] = node.meta[key]
        new_sources.append(ph)
    new_invariants: list[fx.Node] = []
    for k, node in enumerate(invariants):
        if k < len(old_invariants):
            env[old_invariants[k]] = ph = graph.placeholder(old_invariants[k].name)
            ph.meta = copy.copy(old_invariants[k].meta)
        else:
            ph = graph.placeholder(_fresh(taken, "invariant", k))
            ph.meta = {"val": node.meta.get("val")}
        new_invariants.append(ph)
    leaves, tree = tree_flatten((plan.node.args, plan.node.kwargs))
    values: list[Any] = []
    for p, (kind, at) in enumerate(step_leaves):
        if kind == "const":
            values.append(plan.args_fix.get(p, leaves[p]))
        elif kind == "attr":
            attr = unique_attr(old, str(at.target).replace(".", "_"))
            old.register_buffer(attr, fetch_attr(gm, str(at.target)))
            values.append(graph.get_attr(attr))
            values[-1].meta = {"val": at.meta.get("val")}
        else:
            values.append(new_sources[at] if kind == "src" else new_invariants[at])
    step_args, step_kwargs = tree_unflatten(values, tree)
    op = graph.create_node("call_function", plan.node.target, step_args, step_kwargs,
                           name=plan.node.name)  # fmt: skip
    op.meta = {k: v for k, v in plan.node.meta.items() if k in ("nn_module_stack", "stack_trace")}
    op.meta["val"] = plan.val
    env[old_sources[plan.index]] = op
    for node in old.graph.nodes:
        if node.op == "placeholder":
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
    body = fx.GraphModule(old, graph, class_name="StepBody")
    body.meta.update(old.meta)
    graph.lint()
    return body


def _fresh(taken: set[str], prefix: str, k: int) -> str:
    """A placeholder name no other has (its target is the step function's argument name)."""
    while f"{prefix}{k}" in taken:
        k += 1
    taken.add(f"{prefix}{k}")
    return f"{prefix}{k}"
