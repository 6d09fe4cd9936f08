"""From annotations to sharing groups: specs per Value and Use, unions, one spec a group.

Explicit ``SharedSpec``s join groups first; then a Use joins the group of the Value it reads
when the user's annotation allows it and ``sharing.may_merge`` agrees (one integer grid, and
no Value pulled onto a fixed grid it was not given). Otherwise convert requantizes the edge.
"""

from __future__ import annotations

import torch.fx as fx

from quantree.errors import QuantreeError
from quantree.quantizer import Annotation
from quantree.sharing import Group, UnionFind, labels, may_merge, resolve_group_spec
from quantree.specs import SPEC_TYPES, DerivedSpec, SharedSpec, Spec
from quantree.values import Key, Use, Value, is_float_tensor, leaves_with_paths, tensor_meta


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
        if a != b and may_merge(uf.members(a), resolved[a], uf.members(b), resolved[b]):
            uf.union(a, b)
            resolved[uf.find(a)] = resolve_group_spec(uf.members(a), specs)
    return specs, uf


def form_groups(
    annotations: dict[fx.Node, Annotation],
) -> tuple[dict[int, Group], dict[Key, int]]:
    """The sharing groups of a graph's annotations and the group of every Value and Use."""
    specs, uf = _form_groups(annotations)
    groups: dict[int, Group] = {}
    group_of: dict[Key, int] = {}
    for gid, members in enumerate(uf.groups()):
        for m in members:
            group_of[m] = gid
        groups[gid] = Group(gid, resolve_group_spec(members, specs), labels(members))
    for gid, group in groups.items():
        if isinstance(group.spec, DerivedSpec):
            sources = tuple(_source_group(k, group_of, group) for k in group.spec.derived_from)
            groups[gid] = Group(gid, group.spec, group.members, derived_from=sources)
    return groups, group_of


def _source_group(key: Value | Use, group_of: dict[Value | Use, int], group: Group) -> int:
    gid = group_of.get(_canonical(key))
    if gid is None:
        raise QuantreeError(
            f"DerivedSpec of {group.label} derives from {key}, which has no spec; annotate "
            "it (or derive from a quantized Value or Use)"
        )
    return gid
