"""From annotations to sharing groups: specs per Value and Use, unions, one spec a group.

Explicit ``SharedSpec``s join groups first; then a Use joins the group of the Value it reads
when the user's annotation allows it and ``sharing.may_merge`` agrees (one integer grid, and
no Value pulled onto a fixed grid it was not given). Otherwise convert requantizes the edge.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.grouping.sharing import (
    ConcreteSpec,
    Group,
    UnionFind,
    labels,
    may_merge,
    resolve_group_spec,
)
from quantree.core.observing.qparams import per_channel_mismatch
from quantree.core.quantizer import Annotation
from quantree.core.specs import SPEC_TYPES, DerivedSpec, QuantSpec, SharedSpec, Spec
from quantree.core.values import (
    Key,
    Use,
    Value,
    is_float_tensor,
    leaves_with_paths,
    node_of,
    tensor_meta,
    value_of,
)


def _canonical(key: Value | Use) -> Value | Use:
    if isinstance(key, Value):
        return Value.of(key.node, key.path)
    return Use(Value.of(key.value.node, key.value.path), key.user, key.arg_path)


def _is_spec_leaf(x: object) -> bool:
    return x is None or isinstance(x, SPEC_TYPES)


def _where(node: fx.Node) -> str:
    return f"node {node.name} ({node.target})"


def _kind(meta: object) -> str:
    """Why a tensor cannot be a quantization point, in words."""
    dtype = getattr(meta, "dtype", None)
    if dtype is None:
        return f"a {type(meta).__name__}, not a tensor"
    if dtype.is_floating_point:
        return (
            f"{dtype}: the q/dq ops read float32, bfloat16 or float16 (a float64 model: "
            "model.float() with float32 inputs)"
        )
    return f"{dtype}, not a float tensor: only float tensors are quantized"


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
                f"{_kind(value.meta)}; give it None (it stays as it is)"
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
                f"annotation of {_where(node)}: input {list(arg_path)} is "
                f"{_kind(use.value.meta)}; give it None (it stays as it is)"
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
    members_of = dict(enumerate(uf.groups()))
    group_of = {m: gid for gid, members in members_of.items() for m in members}
    groups = {
        gid: _group(gid, members, resolve_group_spec(members, specs), group_of)
        for gid, members in members_of.items()
    }
    _check_per_channel(groups, group_of)
    return groups, group_of


def _group(gid: int, members: list[Key], spec: ConcreteSpec, group_of: dict[Key, int]) -> Group:
    """The group as prepare stores it: a derived group keeps its sources as group ids."""
    if not isinstance(spec, DerivedSpec):
        return Group(gid, spec, labels(members))
    group = Group(gid, spec.derivation, labels(members))
    sources = tuple(_source_group(k, group_of, group) for k in spec.derived_from)
    return dataclasses.replace(group, derived_from=sources)


def _source_group(key: Value | Use, group_of: dict[Value | Use, int], group: Group) -> int:
    gid = group_of.get(_canonical(key))
    if gid is None:
        raise QuantreeError(
            f"DerivedSpec of {group.label} derives from {key}, which has no spec; annotate "
            "it (or derive from a quantized Value or Use)"
        )
    return gid


def _check_per_channel(groups: dict[int, Group], group_of: dict[Key, int]) -> None:
    """Every tensor of a per-channel group has its axis, with one channel count for all.

    Checked on ``meta['val']`` now, so a bad axis names the node instead of failing inside
    an observer during calibration.
    """
    first: dict[int, tuple[Key, int]] = {}
    for key, gid in group_of.items():
        spec = groups[gid].spec
        if not isinstance(spec, QuantSpec) or spec.axis is None:
            continue
        shape = tuple(value_of(key).meta.shape)
        seen = first.get(gid)
        problem = per_channel_mismatch(spec.axis, None if seen is None else seen[1], shape)
        if problem is not None:
            node = node_of(key)
            other = "" if seen is None else f" ({seen[0]} of the same group has {seen[1]})"
            raise QuantreeError(
                f"node {node.name} ({node.target}): per-channel spec of {key} in "
                f"{groups[gid].label}: {problem}{other}; give an axis the tensor has (its "
                "channel axis: 0 for linear/conv weights, 1 for a transposed conv's), or "
                "quantize per tensor (axis=None)"
            )
        if seen is None and isinstance(shape[spec.axis], int):
            first[gid] = (key, shape[spec.axis])
