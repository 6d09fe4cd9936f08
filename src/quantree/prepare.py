"""prepare: annotate a captured graph and insert one observer per sharing group.

Observers are called on tensor leaves only and return nothing anyone reads, so the prepared
model computes exactly what the float model computes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from quantree.canonicalize import canonicalize
from quantree.cells import cell_bodies, decompose
from quantree.errors import QuantreeError, QuantreeWarning
from quantree.fold import fold_batch_norm, own_written_state, written_to
from quantree.graphs import copy_graph_module, fetch_attr
from quantree.grouping import form_groups
from quantree.observers import make_observer
from quantree.quantizer import Annotation, Quantizer, idle_scopes
from quantree.sharing import Group
from quantree.specs import QuantSpec
from quantree.values import (
    Key,
    Path,
    Value,
    is_float_tensor,
    is_getitem,
    leaves_with_paths,
    tensor_meta,
    value_carriers,
    value_of,
)

GROUPS_KEY = "quantree_groups"
STAGE_KEY = "quantree_stage"
"""``gm.meta`` key: ``"prepared"`` or ``"converted"``, so each step refuses the wrong input."""
NODE_KEY = "quantree"
OBSERVER_KEY = "quantree_observer"

_aten = torch.ops.aten
# Ops that only move or create data: leaving them in float loses nothing worth a warning.
LAYOUT_OPS = frozenset(
    op
    for op in (
        _aten.view,
        _aten.reshape,
        _aten._unsafe_view,
        _aten.permute,
        _aten.transpose,
        _aten.t,
        _aten.unsqueeze,
        _aten.squeeze,
        _aten.flatten,
        _aten.expand,
        _aten.contiguous,
        _aten.clone,
        _aten.slice,
        _aten.select,
        _aten.zeros,
        _aten.ones,
        _aten.full,
        _aten.zeros_like,
        _aten.ones_like,
        _aten.dropout,
        _aten.detach,
        _aten.alias,
        _aten._to_copy,
        _aten.to,
        _aten.type_as,
        _aten.lift_fresh_copy,
        _aten.empty,
        _aten.arange,
        _aten.sym_size,
        _aten.copy,
    )
)
# Ops whose ``training`` argument (at this position) makes them compute batch statistics.
_TRAINING_ARG = {
    _aten.batch_norm.default: 5,
    _aten.native_batch_norm.default: 5,
    _aten._native_batch_norm_legit.default: 5,
}


@dataclass(frozen=True)
class NodeQuant:
    """What prepare decided for one annotated node (kept in ``node.meta['quantree']``)."""

    annotation: Annotation
    output_groups: dict[Path, int] = field(default_factory=dict)
    input_groups: dict[Path, int] = field(default_factory=dict)


def _warn_float_ops(gm: fx.GraphModule, annotations: dict[fx.Node, Annotation]) -> None:
    left = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node) or node in annotations:
            continue
        if getattr(node.target, "overloadpacket", None) in LAYOUT_OPS:
            continue
        if any(is_float_tensor(leaf) for _, leaf in leaves_with_paths(tensor_meta(node))):
            left.append(f"{node.target} at {node.name}")
    if left:
        warnings.warn(
            f"quantree left {len(left)} op(s) in float because no rule of the quantizer "
            f"matches them: {', '.join(left)}. Add a Rule for them to quantize them.",
            QuantreeWarning,
            stacklevel=3,
        )


def prepare(gm: fx.GraphModule, quantizer: Quantizer) -> fx.GraphModule:
    """A copy of ``gm`` with observers, ready to calibrate; ``gm`` itself is not changed.

    Recurrent nodes whose annotation asks for cells are first decomposed into cell loops;
    each cell body is then observed like any graph.
    """
    if STAGE_KEY in gm.meta:
        raise QuantreeError(
            f"prepare got a {gm.meta[STAGE_KEY]} model; prepare the graph quantree.capture "
            "returned (each prepare needs a fresh capture or the same captured graph)"
        )
    _check_captured(gm)
    _check_eval_mode(gm)
    gm = canonicalize(fold_batch_norm(own_written_state(copy_graph_module(gm))))
    annotated = list(gm.graph.nodes)  # what the rules see, recurrent nodes included
    decomposed = False
    for node in list(gm.graph.nodes):
        annotation = quantizer.annotate_node(node)
        if annotation is not None and annotation.cells is not None:
            decompose(gm, node, annotation.cells)
            decomposed = True
    if decomposed:
        _drop_export_guards(gm)
    observe(gm, quantizer)
    for body in cell_bodies(gm):
        observe(body, quantizer)
        body.meta[STAGE_KEY] = "prepared"
        annotated += body.graph.nodes
    gm.recompile()
    for idle in idle_scopes(quantizer.rules, annotated):
        warnings.warn(idle.message, QuantreeWarning, stacklevel=2)
    gm.meta[STAGE_KEY] = "prepared"
    return gm


def _check_captured(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            raise QuantreeError(
                f"node {node.name} ({node.target}) has no meta['val']: prepare needs a graph "
                "from quantree.capture (torch.export), not from symbolic tracing"
            )


def _check_eval_mode(gm: fx.GraphModule) -> None:
    """Refuse a graph captured in training mode: its batch norms use batch statistics.

    Such a batch norm cannot be folded or quantized, updates its running statistics on every
    calibration batch, and normalises each batch by itself; quantizing it would silently
    leave a different model in float.
    """
    for node in gm.graph.nodes:
        index = _TRAINING_ARG.get(node.target) if node.op == "call_function" else None
        if index is not None and len(node.args) > index and node.args[index] is True:
            raise QuantreeError(
                f"node {node.name} ({node.target}) runs in training mode (training=True): the "
                "model was captured in train mode. Call model.eval() before capturing it "
                "(quantree.capture captures in eval mode and restores the model's mode)"
            )


def _check_no_written_constant(
    gm: fx.GraphModule, group_of: dict[Key, int], carriers: dict[Value, fx.Node]
) -> None:
    """Refuse to quantize a buffer that an op of the graph writes in place.

    Parameters and buffers are observed once and stored as integer constants, which would
    freeze such state at its captured value and drop every update of it.
    """
    writers = written_to(gm.graph)
    for key in group_of:
        carrier = carriers[value_of(key)]
        writer = writers.get(carrier)
        if carrier.op != "get_attr" or writer is None:
            continue
        raise QuantreeError(
            f"node {writer.name} ({writer.target}) writes {carrier.target} in place, so it is "
            f"state that changes every call, yet {key} gives it a spec: quantree stores "
            "quantized parameters and buffers as integer constants, which would freeze it. "
            f"Leave it in float (annotate {writer.name} and its readers without a spec for "
            f"{carrier.target}), or pass the state in as an input and return its update"
        )


def _drop_export_guards(gm: fx.GraphModule) -> None:
    """Cell loops run any sequence length; export's guard pinned the captured one.

    (torch.export specializes the length of ``aten.lstm``'s input, so it cannot be marked
    dynamic at capture.) Ops elsewhere in the graph still check their own shapes.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)


def observe(gm: fx.GraphModule, quantizer: Quantizer) -> None:
    """Annotate ``gm`` in place and insert one observer per sharing group."""
    annotations = quantizer.annotate(gm)
    groups, group_of = form_groups(annotations)
    carriers = value_carriers(gm.graph)
    _check_no_written_constant(gm, group_of, carriers)

    outputs: dict[fx.Node, dict[Path, int]] = {}
    inputs: dict[fx.Node, dict[Path, int]] = {}
    for key, gid in group_of.items():
        if isinstance(key, Value):
            outputs.setdefault(key.node, {})[key.path] = gid
        else:
            inputs.setdefault(key.user, {})[key.arg_path] = gid
    for node in {*annotations, *outputs, *inputs}:
        annotation = annotations.get(node, Annotation())
        node.meta[NODE_KEY] = NodeQuant(annotation, outputs.get(node, {}), inputs.get(node, {}))

    observed: dict[int, set[fx.Node]] = {}
    for key, gid in group_of.items():
        value = value_of(key)
        observed.setdefault(gid, set()).add(carriers[value])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for gid, nodes in observed.items():
        group = groups[gid]
        if not isinstance(group.spec, QuantSpec):
            continue
        name = f"observer_{gid}"
        observer = make_observer(group.spec, group.label)
        gm.add_submodule(name, observer)
        groups[gid] = Group(gid, group.spec, group.members, observer=name)
        for carrier in sorted(nodes):
            if carrier.op == "get_attr":  # a constant: observe it once, now
                observer(fetch_attr(gm, str(carrier.target)))
                continue
            anchor = placeholders[-1] if carrier.op == "placeholder" else carrier
            with gm.graph.inserting_after(anchor):
                call = gm.graph.call_module(name, (carrier,))
            call.meta[OBSERVER_KEY] = gid
    gm.meta[GROUPS_KEY] = groups
    _warn_float_ops(gm, annotations)
    gm.graph.lint()
    gm.recompile()
