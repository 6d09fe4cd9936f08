"""The parameters of every sharing group once calibration is done: fixed, observed, derived.

Kept apart from ``convert`` (which rewrites the graph) because this is arithmetic on groups:
derived groups are resolved after the groups they derive from, user ``derive`` functions are
checked, and groups that were never observed or whose range vanished are named.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.grouping.sharing import Group
from quantree.core.observing.qparams import at_scale_floor, fixed_qparams
from quantree.core.observing.threads import one_intra_op_thread
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

    with one_intra_op_thread():  # small tensors: see observing/threads.py
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
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    activations = [g for g in groups.values() if g.observer is not None and g.observer in called]
    # observers of constants (weights) are calibrated at prepare and have no call node
    if all(g in missing for g in activations):
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
    graph: fx.Graph,
    groups: dict[int, Group],
    params: dict[int, QParams],
    module: torch.nn.Module | None = None,
) -> list[str]:
    """Groups observed on run-time tensors whose scale is at the floor.

    Constants (weights) are left out: their range is exact, and an all-zero row of a pruned
    weight is quantized exactly. So are groups (with ``module``, which holds the observers)
    computed from no input that only ever held exact zeros, such as a recurrent layer's zero
    initial state or a decoder's zero first frame: the zero point represents them exactly,
    and no calibration data could change them. A ReLU that never fired is still named.
    """
    observed = {n.meta[OBSERVER_KEY] for n in graph.nodes if OBSERVER_KEY in n.meta}
    fed = _input_dependent(graph) if module is not None else set()
    by_inputs = {
        n.meta[OBSERVER_KEY]
        for n in graph.nodes
        if OBSERVER_KEY in n.meta and any(a in fed for a in n.all_input_nodes)
    }
    return [
        groups[gid].label
        for gid in sorted(observed)
        if gid in params
        and at_scale_floor(params[gid])
        and (gid in by_inputs or not _only_zeros(module, groups[gid].observer))
    ]


_SHAPE_ONLY = {
    *("zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones"),
    *("new_full", "new_empty", "size", "sym_size"),
}
"""Ops whose values do not depend on the values of their tensor arguments."""


def _input_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose values depend on the graph's inputs (placeholders)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        name = str(getattr(node.target, "__name__", node.target)).split(".")[0]
        if node.op == "placeholder" or (
            name not in _SHAPE_ONLY and any(a in found for a in node.all_input_nodes)
        ):
            found.add(node)
    return found


def _only_zeros(module: torch.nn.Module | None, observer: str | None) -> bool:
    found = getattr(module, observer, None) if module is not None and observer else None
    lo, hi = getattr(found, "min_val", None), getattr(found, "max_val", None)
    if not isinstance(lo, torch.Tensor) or not isinstance(hi, torch.Tensor) or not lo.numel():
        return False
    return bool((lo == 0).all()) and bool((hi == 0).all())


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
