"""Fold what is known before calibration: parameter-only computations and eval batch norm.

A weight that reaches a linear through ops on parameters alone (the ``chunk`` of a fused QKV
weight in ``nn.MultiheadAttention``, a transpose) is a constant: folding it into one lets the
recipe quantize it as a weight (per channel, stored as integers) instead of observing it as
an activation. A batch norm after a conv is an affine map per output channel; folding it into
the weights and bias leaves one op to quantize instead of a float op between two quantized
ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.utils import _pytree as pytree

from quantree.core.graphs import attr_at, register_constant

aten = torch.ops.aten
_FOLDABLE = (
    aten.conv1d.default,
    aten.conv1d.padding,
    aten.conv2d.default,
    aten.conv2d.padding,
    aten.linear.default,
)
_BN_CHANNEL_AXIS = 1


def _written_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs an in-place op writes to (``x`` of ``x.add_(1)``)."""
    schema = node.target._schema if isinstance(node.target, OpOverload) else None
    if schema is None:
        return []
    written: list[fx.Node] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written += _nodes_in(given)
    return written


def _nodes_in(arg: object) -> list[fx.Node]:
    return [n for n in pytree.tree_leaves(arg) if isinstance(n, fx.Node)]


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s result aliases its input (a view, a getitem of a split)."""
    if node.target is operator.getitem:
        return True
    schema = node.target._schema if isinstance(node.target, OpOverload) else None
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def written_to(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Nodes whose memory an in-place op writes, followed back through views, each with
    the in-place node that writes it (the first, in graph order).

    Such a node must keep running every call: a folded copy would carry one call's writes
    into the next (or lose them). The writer is what an error about it names.
    """
    written: dict[fx.Node, fx.Node] = {}
    for writer in graph.nodes:
        stack = _written_inputs(writer)
        while stack:
            node = stack.pop()
            if node in written:
                continue
            written[node] = writer
            if _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
                stack.append(node.args[0])
    return written


def own_written_state(gm: fx.GraphModule) -> fx.GraphModule:
    """Give ``gm`` its own copy of every parameter or buffer its graph writes in place.

    ``copy_graph_module`` shares tensors with the module it copies, which is safe only for
    tensors nothing writes: running a prepared model (calibration) would otherwise update
    the state of the captured graph and of the user's model. The owners of ``get_attr``
    targets in such a copy are its own containers (fx copies the path), so replacing the
    tensor there leaves the source alone. Returns ``gm``.
    """
    for node in written_to(gm.graph):
        if node.op != "get_attr":
            continue
        prefix, _, leaf = str(node.target).rpartition(".")
        owner = gm.get_submodule(prefix)
        value = getattr(owner, leaf, None)
        if isinstance(value, torch.nn.Parameter):
            setattr(owner, leaf, torch.nn.Parameter(value.detach().clone(), value.requires_grad))
        elif isinstance(value, torch.Tensor):
            setattr(owner, leaf, value.clone())
    return gm


def _computes_from(node: fx.Node, known: dict[fx.Node, object]) -> bool:
    """Whether ``node`` is a deterministic, non-mutating op on ``known`` values only."""
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    if not all(n in known for n in node.all_input_nodes):
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, OpOverload) or node.target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in node.target.tags


def run_on(node: fx.Node, known: dict[fx.Node, object]) -> object:
    """``node``'s op run on the ``known`` values of its inputs."""
    args, kwargs = pytree.tree_map_only(fx.Node, known.__getitem__, (node.args, node.kwargs))
    with torch.no_grad():
        return node.target(*args, **kwargs)  # type: ignore[operator]


def known_values(
    gm: fx.GraphModule,
    value_of: Callable[[fx.Node, dict[fx.Node, object]], object],
    settle: bool = False,
) -> dict[fx.Node, object]:
    """The values ``gm``'s graph holds before any input arrives: its tensor attributes, then,
    in graph order, each node ``value_of`` gives a value for (None: it stays computed),
    given the values known so far. Nodes whose output the graph writes to are never known.

    The one walk behind both folding passes (parameter-only computations before calibration
    here, input-independent tensors after lowering in the CPU backend); they differ only in
    which ops they let run. With ``settle``, in-place writes into a fresh tensor that no
    one reads before the last write (``settled_writes``) run too, in graph order, on the
    real tensors: the writes land in the fresh tensor and its views as they would at run
    time, so the values are those every later reader sees.
    """
    pinned = written_to(gm.graph)
    settled = settled_writes(gm.graph) if settle else {}
    known: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        group = settled.get(node)
        if group is not None and node in group.writers:
            if all(n in known for n in node.all_input_nodes) and _repeatable(node):
                known[node] = run_on(node, known)  # writes into the group's fresh root
            else:  # the write depends on an input: nothing of the group is known
                for member in group.members:
                    known.pop(member, None)
            continue
        if node in pinned and group is None:
            continue
        if node.op == "get_attr" and isinstance(attr_at(gm, str(node.target)), torch.Tensor):
            known[node] = attr_at(gm, str(node.target))
            continue
        value = value_of(node, known)
        root = value is not None and group is not None and node is group.root
        if root and (not isinstance(value, torch.Tensor) or _storage(value) in _storages(known)):
            continue  # not fresh after all: a write would reach a parameter
        if value is not None:
            known[node] = value
    return known


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(known: dict[fx.Node, object]) -> set[int]:
    """The storages of the tensors known so far (parameters and buffers among them)."""
    return {_storage(v) for v in known.values() if isinstance(v, torch.Tensor)}


@dataclass(frozen=True)
class WriteGroup:
    """A fresh tensor (``root``), the views of it, and the in-place ops writing into them."""

    root: fx.Node
    members: frozenset[fx.Node]
    writers: frozenset[fx.Node]


def _repeatable(node: fx.Node) -> bool:
    return (
        isinstance(node.target, OpOverload)
        and torch.Tag.nondeterministic_seeded not in node.target.tags
    )


def settled_writes(graph: fx.Graph) -> dict[fx.Node, WriteGroup]:
    """Each node of a write group whose writes all happen before anyone else reads it.

    torchvision's Swin V2 zeroes the key third of a ``clone`` of its qkv bias
    (``clone -> slice -> zero_``) and runs its position-bias MLP as ``linear -> relu_``, all
    on parameters alone. Written in place, those tensors were pinned as written-to, so the
    bias and the MLP were observed and quantized as activations and computed on every call.
    The root must be fresh (an op whose result aliases none of its inputs: no parameter
    is ever written) and every reader outside the group must come after the group's last
    write; then running the group in graph order gives every reader what it reads at run
    time, and the group can fold like any parameter-only computation.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[fx.Node, WriteGroup] = {}
    roots: dict[fx.Node, None] = {}
    for writer in graph.nodes:
        for node in _written_inputs(writer):
            while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
                node = node.args[0]
            roots[node] = None
    for root in roots:
        if root.op != "call_function" or _is_view(root) or not _repeatable(root):
            continue
        members, stack = {root}, [root]
        while stack:  # every alias of the root: views of views, in-place results
            for user in stack.pop().users:
                if user not in members and _is_view(user) and user.args[0] in members:
                    members.add(user)
                    stack.append(user)
        writers = {w for m in members for w in m.users if set(_written_inputs(w)) & members}
        readers = {u for m in members for u in m.users} - members - writers
        last = max((order[w] for w in writers), default=-1)
        if not writers or any(order[r] < last for r in readers):
            continue
        if any(w.op != "call_function" or not _repeatable(w) for w in writers):
            continue
        group = WriteGroup(root, frozenset(members | writers), frozenset(writers))
        for node in group.members:
            if node in groups:  # written together with another root: keep both computed
                break
        else:
            groups.update(dict.fromkeys(group.members, group))
    return groups


def fold_constants(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every tensor computed from parameters and buffers alone by a constant, in place.

    Ops that depend on an input, draw random numbers or write memory keep running. The folded
    tensor is the op's own result (a view stays a view of the parameter), so the graph
    computes exactly what it computed before.
    """
    graph = gm.graph
    known = known_values(
        gm, lambda n, k: run_on(n, k) if _computes_from(n, k) else None, settle=True
    )
    for node, value in known.items():
        if node.op == "get_attr" or not isinstance(value, torch.Tensor):
            continue
        if all(user in known for user in node.users):
            continue
        with graph.inserting_before(node):
            constant = graph.get_attr(register_constant(gm, "_folded_", value.detach()))
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
    graph.eliminate_dead_code()
    writes = [n for n in known if n.op == "call_function" and _written_inputs(n)]
    for node in reversed(writes):  # folded writes: what they wrote is in a constant now
        if not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _constant(gm: fx.GraphModule, arg: object) -> torch.Tensor | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = attr_at(gm, str(arg.target))
        return value if isinstance(value, torch.Tensor) else None
    return None


def _optional_constants(
    gm: fx.GraphModule, args: Sequence[object]
) -> list[torch.Tensor | None] | None:
    """Each argument as a tensor (None where absent); None if any is computed at run time."""
    values = [None if a is None else _constant(gm, a) for a in args]
    if any(v is None and a is not None for v, a in zip(values, args, strict=True)):
        return None
    return values


def _channel_axis(producer: fx.Node) -> int:
    """The output axis of a conv/linear that indexes its output channels.

    Batch dims come first, then the channel axis, then one axis per spatial dim of the weight
    (none for linear): ``[N, C]`` and ``[N, C, H, W]`` have it at 1, ``[N, L, C]`` at 2.
    """
    weight = producer.args[1]
    assert isinstance(weight, fx.Node)
    out, w = producer.meta["val"], weight.meta["val"]
    return int(out.dim() - w.dim() + 1)


FOLD_TOLERANCE = 1e-5
"""How far a model with batch norm folded may be from float: per output tensor,
``max |prepared - float| <= FOLD_TOLERANCE * max |float|``. Folding scales the weights, so
the products and sums round differently (measured: at most 3e-7 on random conv/linear +
batch norm pairs with running statistics far from 0 and 1); it is not bit-equal."""


def fold_batch_norm(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``conv/linear -> batch_norm(training=False)`` in place; returns ``gm``.

    Parameter-only computations are folded first (``fold_constants``): a weight computed from
    parameters is a constant too, and both folds need the weight as one.
    """
    fold_constants(gm)
    graph = gm.graph
    for bn in list(graph.nodes):
        if bn.op == "call_function" and bn.target is aten.batch_norm.default:
            _fold_one(gm, bn)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _fold_one(gm: fx.GraphModule, bn: fx.Node) -> None:
    """Fold one batch norm into its producer when it normalises the producer's channels."""
    graph = gm.graph
    producer, gamma, beta, mean, var, training, _, eps = bn.args[:8]
    if training or not isinstance(producer, fx.Node) or producer.target not in _FOLDABLE:
        return
    assert isinstance(eps, float)
    if len(producer.users) != 1 or _channel_axis(producer) != _BN_CHANNEL_AXIS:
        return
    bias_arg = producer.args[2] if len(producer.args) > 2 else None
    found = _optional_constants(gm, [producer.args[1], bias_arg, gamma, beta, mean, var])
    if found is None:
        return
    weight, bias, g, b, stats_mean, stats_var = found
    if weight is None or stats_mean is None or stats_var is None:
        return
    with torch.no_grad():
        scale = torch.rsqrt(stats_var + eps)
        if g is not None:
            scale = scale * g
        shift = -stats_mean * scale
        if b is not None:
            shift = shift + b
        if bias is not None:
            shift = shift + bias * scale
        folded = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    with graph.inserting_before(producer):
        w_node = graph.get_attr(register_constant(gm, "_folded_weight_", folded.detach()))
        b_node = graph.get_attr(register_constant(gm, "_folded_bias_", shift.detach()))
    w_node.meta["val"], b_node.meta["val"] = folded, shift
    args = list(producer.args)
    args[1] = w_node
    if len(args) > 2:
        args[2] = b_node
    else:
        args.append(b_node)
    producer.args = tuple(args)
    bn.replace_all_uses_with(producer)
    graph.erase_node(bn)
