"""The parameters of every sharing group once calibration is done: fixed, observed, derived.

Kept apart from ``convert`` (which rewrites the graph) because this is arithmetic on groups:
derived groups are resolved after the groups they derive from, user ``derive`` functions are
checked, and groups that were never observed or whose range vanished are named.
"""

from __future__ import annotations

import re

import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.qparams import at_scale_floor, fixed_qparams
from quantree.core.sharing import Group
from quantree.core.specs import Derivation, FixedSpec, QParams
from quantree.core.stages import OBSERVER_KEY


def resolve_params(groups: dict[int, Group], gm: fx.GraphModule) -> dict[int, QParams]:
    """Parameters of every group; derived groups after the groups they derive from."""
    done: dict[int, QParams] = {}

    def visit(gid: int, trail: tuple[int, ...]) -> QParams:
        if gid in done:
            return done[gid]
        if gid in trail:
            raise QuantreeError(f"DerivedSpec cycle through {groups[gid].label}")
        group = groups[gid]
        if isinstance(group.spec, FixedSpec):
            params = fixed_qparams(group.spec)
        elif isinstance(group.spec, Derivation):
            sources = [visit(s, (*trail, gid)) for s in group.derived_from]
            params = derived(group, group.spec, sources)
        else:
            assert group.observer is not None
            params = gm.get_submodule(group.observer).qparams()  # type: ignore[operator]
        done[gid] = params
        return params

    for gid in groups:
        visit(gid, ())
    return done


def derived(group: Group, derivation: Derivation, sources: list[QParams]) -> QParams:
    """What a DerivedSpec's ``derive`` returns, checked: it is user code."""
    params = derivation.derive(sources)
    if not isinstance(params, QParams):
        raise QuantreeError(
            f"the derive function of the DerivedSpec of {group.label} returned "
            f"{type(params).__name__}, not QParams; return quantree.QParams(scale, zero_point, "
            "dtype, quant_min, quant_max, axis)"
        )
    if params.dtype != derivation.dtype:
        raise QuantreeError(
            f"the derive function of the DerivedSpec of {group.label} returned "
            f"{params.dtype.value} parameters, but the spec declares {derivation.dtype.value}; "
            "return parameters of the declared dtype, or declare the dtype it returns "
            "(DerivedSpec(..., dtype=...))"
        )
    return params


def check_calibrated(gm: fx.GraphModule, groups: dict[int, Group]) -> None:
    """Every observer saw data; else say which nodes, where, and why.

    When no observer saw anything, calibration did not run. When only some did, calibration
    ran but never reached those tensors: every batch gave them an empty tensor (a zero-length
    memory or context), or no batch ran the code holding them (a graph nested in a module
    that only some inputs call).
    """
    missing = [g for g in groups.values() if g.observer is not None and not _observer(gm, g)[0]]
    if not missing:
        return
    if len(missing) == sum(g.observer is not None for g in groups.values()):
        raise QuantreeError(
            f"{missing[0].label} was never observed: convert needs calibration first. Run the "
            "prepared model on representative inputs (or use quantree.calibrate) before "
            "calling convert"
        )
    raise QuantreeError(
        f"calibration ran but never observed {describe_unobserved(gm, missing)}. Feed "
        "calibration inputs that give these tensors data (e.g. a non-zero context or memory "
        "length, inputs that take the branch holding them), or convert with "
        "unobserved=quantree.Unobserved.FLOAT to leave them in float"
    )


def unobserved_groups(gm: fx.GraphModule, groups: dict[int, Group]) -> list[Group]:
    return [g for g in groups.values() if g.observer is not None and not _observer(gm, g)[0]]


def describe_unobserved(gm: fx.GraphModule, missing: list[Group]) -> str:
    """Each group's label, module scope and why it is empty, for messages."""
    parts = []
    for group in missing[:10]:
        _, empty = _observer(gm, group)
        why = f"received only empty tensors ({empty} calls)" if empty else "never ran"
        parts.append(f"{group.label} in module {_scope(gm, group) or '<top>'}: {why}")
    more = f"; and {len(missing) - 10} more" if len(missing) > 10 else ""
    return "; ".join(parts) + more


def _observer(gm: fx.GraphModule, group: Group) -> tuple[bool, int]:
    observer = gm.get_submodule(str(group.observer))
    return bool(observer.calibrated), int(getattr(observer, "empty_batches", 0))


def _scope(gm: fx.GraphModule, group: Group) -> str:
    """The innermost module (from export's ``nn_module_stack``) of the group's nodes."""
    names = set(re.findall(r"[A-Za-z_]\w*", str(group.label)))
    for node in gm.graph.nodes:
        if node.name in names:
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                return str(list(stack.values())[-1][0])
    return ""


def vanishing_groups(
    graph: fx.Graph, groups: dict[int, Group], params: dict[int, QParams]
) -> list[str]:
    """Groups observed on run-time tensors whose scale is at the floor.

    Constants (weights) are left out: their range is exact, and an all-zero row of a pruned
    weight is quantized exactly; so are groups that only hold tensors the graph creates as
    zeros (a recurrent layer's default initial state): 0 is exact on every grid.
    """
    carriers: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if OBSERVER_KEY in n.meta:
            carriers.setdefault(n.meta[OBSERVER_KEY], []).append(n.args[0])
    return [
        groups[gid].label
        for gid in sorted(carriers)
        if gid in params
        and at_scale_floor(params[gid])
        and not all(_creates_zeros(c) for c in carriers[gid])
    ]


_ZERO_FACTORIES = {"zeros", "zeros_like", "new_zeros"}


def _creates_zeros(node: object) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) in _ZERO_FACTORIES


def with_dependents(gids: set[int], groups: dict[int, Group]) -> set[int]:
    """``gids`` and every group derived from them (a bias scale needs its input's)."""
    result = set(gids)
    grew = True
    while grew:
        grew = False
        for group in groups.values():
            if group.id not in result and set(group.derived_from) & result:
                result.add(group.id)
                grew = True
    return result
