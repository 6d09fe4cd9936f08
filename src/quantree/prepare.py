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
from quantree.fold import fold_batch_norm
from quantree.graphs import copy_graph_module, fetch_attr
from quantree.observers import make_observer
from quantree.quantizer import Annotation, Quantizer
from quantree.sharing import Group, UnionFind, compatible, labels, resolve_group_spec
from quantree.specs import SPEC_TYPES, DerivedSpec, QuantSpec, SharedSpec, Spec
from quantree.values import (
    Key,
    Path,
    Use,
    Value,
    is_float_tensor,
    is_getitem,
    leaves_with_paths,
    tensor_meta,
    value_carriers,
)

GROUPS_KEY = "quantree_groups"
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


@dataclass(frozen=True)
class NodeQuant:
    """What prepare decided for one annotated node (kept in ``node.meta['quantree']``)."""

    annotation: Annotation
    output_groups: dict[Path, int] = field(default_factory=dict)
    input_groups: dict[Path, int] = field(default_factory=dict)


def _canonical(key: Value | Use) -> Value | Use:
    if isinstance(key, Value):
        return Value.of(key.node, key.path)
    return Use(Value.of(key.value.node, key.value.path), key.user, key.arg_path)


def _is_spec_leaf(x: object) -> bool:
    return x is None or isinstance(x, SPEC_TYPES)


def _where(node: fx.Node) -> str:
    return f"node {node.name} ({node.target})"


def _output_specs(node: fx.Node, annotation: Annotation) -> dict[Key, Spec]:
    meta = tensor_meta(node)
    if annotation.outputs is None:
        return {}
    given = dict(leaves_with_paths(annotation.outputs, is_leaf=_is_spec_leaf))
    expected = {path for path, _ in leaves_with_paths(meta)}
    if set(given) != expected:
        raise QuantreeError(
            f"annotation of {_where(node)}: output spec leaves at {sorted(given, key=str)} do "
            f"not match the output's leaves at {sorted(expected, key=str)}; shape the output "
            "spec like the output (None for leaves left in float)"
        )
    specs: dict[Key, Spec] = {}
    for path, spec in given.items():
        if spec is None:
            continue
        value = Value.of(node, path)
        if not is_float_tensor(value.meta):
            raise QuantreeError(
                f"annotation of {_where(node)}: output {list(path)} is "
                f"{getattr(value.meta, 'dtype', type(value.meta).__name__)}, not a float "
                "tensor; give it None"
            )
        specs[value] = spec
    return specs


def _input_specs(node: fx.Node, annotation: Annotation) -> dict[Key, Spec]:
    specs: dict[Key, Spec] = {}
    for arg_path, spec in annotation.inputs.items():
        if spec is None:
            continue
        if not isinstance(spec, SPEC_TYPES):
            raise QuantreeError(f"annotation of {_where(node)}: {spec!r} is not a spec")
        use = Use.of(node, tuple(arg_path))
        if not is_float_tensor(use.value.meta):
            raise QuantreeError(
                f"annotation of {_where(node)}: input {list(arg_path)} is not a float tensor; "
                "only float tensors are quantized"
            )
        specs[use] = spec
    return specs


def _form_groups(
    annotations: dict[fx.Node, Annotation],
) -> tuple[dict[Value | Use, Spec], UnionFind]:
    specs: dict[Value | Use, Spec] = {}
    for node, annotation in annotations.items():
        specs.update(_output_specs(node, annotation))
        specs.update(_input_specs(node, annotation))
    uf = UnionFind()
    for key in sorted(specs, key=lambda k: isinstance(k, Use)):  # Values first: they lead
        uf.add(key)
    for key, spec in specs.items():
        if isinstance(spec, SharedSpec):
            uf.union(key, _canonical(spec.target))
    resolved = {}
    for members in uf.groups():
        resolved[uf.find(members[0])] = resolve_group_spec(members, specs)
    for key in list(specs):
        if not isinstance(key, Use) or key.value not in specs:
            continue
        if not annotations[key.user].share_with_producers:
            continue
        a, b = uf.find(key), uf.find(key.value)
        if a != b and compatible(resolved[a], resolved[b]):
            uf.union(a, b)
            resolved[uf.find(a)] = resolve_group_spec(uf.members(a), specs)
    return specs, uf


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
    _check_captured(gm)
    gm = canonicalize(fold_batch_norm(copy_graph_module(gm)))
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
    gm.recompile()
    return gm


def _check_captured(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            raise QuantreeError(
                f"node {node.name} ({node.target}) has no meta['val']: prepare needs a graph "
                "from quantree.capture (torch.export), not from symbolic tracing"
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
    specs, uf = _form_groups(annotations)
    carriers = value_carriers(gm.graph)

    groups: dict[int, Group] = {}
    group_of: dict[Value | Use, int] = {}
    for gid, members in enumerate(uf.groups()):
        spec = resolve_group_spec(members, specs)
        for m in members:
            group_of[m] = gid
        groups[gid] = Group(gid, spec, labels(members))
    for gid, group in groups.items():
        if isinstance(group.spec, DerivedSpec):
            sources = tuple(_source_group(k, group_of, group) for k in group.spec.derived_from)
            groups[gid] = Group(gid, group.spec, group.members, derived_from=sources)

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
        value = key if isinstance(key, Value) else key.value
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


def _source_group(key: Value | Use, group_of: dict[Value | Use, int], group: Group) -> int:
    gid = group_of.get(_canonical(key))
    if gid is None:
        raise QuantreeError(
            f"DerivedSpec of {group.label} derives from {key}, which has no spec; annotate "
            "it (or derive from a quantized Value or Use)"
        )
    return gid
