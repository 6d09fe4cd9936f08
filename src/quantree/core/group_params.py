"""The parameters of every sharing group once calibration is done: fixed, observed, derived.

Kept apart from ``convert`` (which rewrites the graph) because this is arithmetic on groups:
derived groups are resolved after the groups they derive from, user ``derive`` functions are
checked, and groups that were never observed or whose range vanished are named.
"""

from __future__ import annotations

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
    for group in groups.values():
        if group.observer is None:
            continue
        if not gm.get_submodule(group.observer).calibrated:  # type: ignore[operator]
            raise QuantreeError(
                f"{group.label} was never observed: convert needs calibration first. Run the "
                "prepared model on representative inputs (or use quantree.calibrate) before "
                "calling convert"
            )


def vanishing_groups(
    graph: fx.Graph, groups: dict[int, Group], params: dict[int, QParams]
) -> list[str]:
    """Groups observed on run-time tensors whose scale is at the floor.

    Constants (weights) are left out: their range is exact, and an all-zero row of a pruned
    weight is quantized exactly.
    """
    observed = {n.meta[OBSERVER_KEY] for n in graph.nodes if OBSERVER_KEY in n.meta}
    return [groups[gid].label for gid in sorted(observed) if at_scale_floor(params[gid])]
