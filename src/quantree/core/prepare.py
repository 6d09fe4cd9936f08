"""prepare: annotate a captured graph and insert one observer per sharing group.

Observers are called on tensor leaves only and return nothing anyone reads, so the prepared
model computes exactly what the float model computes, except where prepare rewrites the
arithmetic first: batch norm folded into conv/linear weights is within
``fold.FOLD_TOLERANCE`` of float (relative to each output's largest magnitude), a cells-mode
decomposition within 1e-6.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx

from quantree.core.annotate import annotate, warn_float_ops
from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.graphs import fetch_attr, nested_graphs
from quantree.core.grouping.groups import form_groups
from quantree.core.grouping.sharing import Group
from quantree.core.normalizing.fold import written_to
from quantree.core.normalizing.normalize import normalize
from quantree.core.observing.kinds import make_observer
from quantree.core.observing.observers import NonFiniteValues, Observer
from quantree.core.quantizer import Annotation, Quantizer, idle_scopes
from quantree.core.specs import QuantSpec
from quantree.core.stages import GROUPS_KEY, NODE_KEY, OBSERVER_KEY, PREPARED, STAGE_KEY, NodeQuant
from quantree.core.values import Key, Path, Value, value_carriers, value_of

# Ops whose ``training`` argument (at this position) makes them compute batch statistics.
_TRAINING_ARG = {
    torch.ops.aten.batch_norm.default: 5,
    torch.ops.aten.native_batch_norm.default: 5,
    torch.ops.aten._native_batch_norm_legit.default: 5,
}


def prepare(
    gm: fx.GraphModule, quantizer: Quantizer | Any, *, stacklevel: int = 2
) -> fx.GraphModule:
    """A copy of ``gm`` with observers, ready to calibrate; ``gm`` itself is not changed.

    ``quantizer`` is a quantree ``Quantizer``; ``quantree.prepare`` also takes a pt2e one
    (torchao's ``Quantizer``), wrapped by ``quantree.recipes.pt2e`` into one whose ``bind``
    translates its annotations.

    Nodes whose annotation carries a ``decompose`` hook are replaced first (cells mode's
    loops); every graph nested in the modules that adds is then observed like the main one.
    ``stacklevel`` is where its warnings point, as ``warnings.warn`` counts (2: the caller;
    ``quantree.prepare``, which calls this one, passes 3 so they point at its own caller).
    """
    if STAGE_KEY in gm.meta:
        raise QuantreeError(
            f"prepare got a {gm.meta[STAGE_KEY]} model; prepare the graph quantree.capture "
            "returned (each prepare needs a fresh capture or the same captured graph)"
        )
    _check_captured(gm)
    _check_eval_mode(gm)
    _check_no_nan_constants(gm)
    gm = normalize(gm)
    gm, quantizer = _bind(gm, quantizer)
    seen = list(gm.graph.nodes)  # what the rules see, nodes later decomposed included
    observe(gm, annotate(gm, quantizer), stacklevel + 1)
    for body in nested_graphs(gm).values():
        seen += body.graph.nodes
        observe(body, annotate(body, quantizer), stacklevel + 1)
        body.meta[STAGE_KEY] = PREPARED
    gm.recompile()
    for idle in idle_scopes(quantizer.rules, seen):
        warnings.warn(idle.message, QuantreeWarning, stacklevel=stacklevel)
    gm.meta[STAGE_KEY] = PREPARED
    return gm


def _bind(gm: fx.GraphModule, quantizer: Any) -> tuple[fx.GraphModule, Quantizer]:
    """What ``prepare`` annotates with: ``quantizer.bind(gm)``, for a quantree quantizer."""
    if isinstance(quantizer, Quantizer):
        return quantizer.bind(gm)
    raise QuantreeError(
        f"prepare needs a quantree Quantizer (e.g. qt.Int8Quantizer()) or a pt2e Quantizer "
        f"(torchao's X86InductorQuantizer, ExecuTorch's), got {type(quantizer).__name__}"
    )


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
    leave a different model in float. One without running statistics on parameters alone
    is not a mode but arithmetic on weights (timm's NFNet standardises each conv's weight
    with ``F.batch_norm(w, None, None, training=True)``): it folds to a constant weight.
    """
    reached = _input_dependent(gm.graph)
    for node in gm.graph.nodes:
        index = _TRAINING_ARG.get(node.target) if node.op == "call_function" else None
        if index is None or len(node.args) <= index or node.args[index] is not True:
            continue
        stats = node.args[3:5]
        if all(s is None for s in stats) and node.args[0] not in reached:
            continue
        if all(s is None for s in stats):
            raise QuantreeError(
                f"node {node.name} ({node.target}) normalises its input by the statistics of "
                "each batch (training=True, no running statistics, as F.batch_norm(x, None, "
                "None, training=True)): the output of one sample depends on the others in its "
                "batch, which a quantized model cannot reproduce. Use running statistics or a "
                "per-sample norm (nn.InstanceNorm / nn.GroupNorm) in the model"
            )
        raise QuantreeError(
            f"node {node.name} ({node.target}) runs in training mode (training=True): the "
            "model was captured in train mode. Call model.eval() before capturing it "
            "(quantree.capture captures in eval mode and restores the model's mode)"
        )


def _input_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes a graph input reaches."""
    reached: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(n in reached for n in node.all_input_nodes):
            reached.add(node)
    return reached


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


def _observe_constant(observer: Observer, gm: fx.GraphModule, carrier: fx.Node) -> None:
    """Observe a parameter or buffer now; one holding NaN or infinity is the model's fault."""
    try:
        observer(fetch_attr(gm, str(carrier.target)))
        observer.mark_shared()  # every process observes it: it counts once in a merge
    except NonFiniteValues:
        readers = ", ".join(f"{u.name} ({u.target})" for u in carrier.users)
        raise QuantreeError(
            f"the model's parameter or buffer {carrier.target} (read by {readers}) holds NaN or "
            "infinity, so it cannot be quantized: the model itself is broken, not the "
            "calibration data. Load finite weights (check torch.isfinite(t).all() for each "
            "tensor of model.state_dict()) and capture the model again"
        ) from None


def _check_no_nan_constants(gm: fx.GraphModule) -> None:
    """Refuse a model whose parameters hold NaN or infinity, or buffers NaN, before calibrating.

    (Infinity in a buffer can be meant, as in an attention mask; it is refused where it is
    quantized.)
    """
    bad = [
        name
        for name, t in gm.named_parameters()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ] + [
        name
        for name, t in gm.named_buffers()
        if t.is_floating_point() and bool(torch.isnan(t).any())
    ]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise QuantreeError(
            f"the model's parameter(s) or buffer(s) {shown} hold NaN or infinity: the model "
            "itself is broken, not the calibration data. Load finite weights (check "
            "torch.isfinite(t).all() for each tensor of model.state_dict()) and capture it again"
        )


def observe(
    gm: fx.GraphModule, annotations: dict[fx.Node, Annotation], stacklevel: int = 3
) -> None:
    """Record ``annotations`` on ``gm`` in place and insert one observer per sharing group."""
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
                _observe_constant(observer, gm, carrier)
                continue
            anchor = placeholders[-1] if carrier.op == "placeholder" else carrier
            with gm.graph.inserting_after(anchor):
                call = gm.graph.call_module(name, (carrier,))
            call.meta[OBSERVER_KEY] = gid
    gm.meta[GROUPS_KEY] = groups
    warn_float_ops(gm, annotations, stacklevel + 1)
    gm.graph.lint()
    gm.recompile()
