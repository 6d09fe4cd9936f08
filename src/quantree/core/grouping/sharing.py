"""Sharing groups: a union-find over Values and Uses, and the spec each group resolves to.

One group gets one observer and one set of quantization parameters. Groups are formed by
explicit ``SharedSpec``s (transitively) and by implicit sharing between a Value and the Uses
that read it when their specs describe the same integer grid and the merge cannot narrow
the range of a Value (see ``may_merge``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from quantree.core.errors import QuantreeError
from quantree.core.specs import (
    Derivation,
    DerivedSpec,
    FixedSpec,
    QParams,
    QuantSpec,
    SharedSpec,
    Spec,
)
from quantree.core.values import Key, Value

ConcreteSpec = QuantSpec | FixedSpec | DerivedSpec
GroupSpec = QuantSpec | FixedSpec | Derivation
"""What a group keeps of its spec: no Value or Use, so no graph node (see ``Derivation``)."""


class UnionFind:
    """Disjoint sets with path halving; the first-added member of a set is its root."""

    def __init__(self) -> None:
        self._parent: dict[Key, Key] = {}
        self._order: dict[Key, int] = {}
        self._members: dict[Key, list[Key]] = {}

    def add(self, key: Key) -> None:
        if key not in self._parent:
            self._parent[key] = key
            self._order[key] = len(self._order)
            self._members[key] = [key]

    def find(self, key: Key) -> Key:
        self.add(key)
        while self._parent[key] != key:
            self._parent[key] = self._parent[self._parent[key]]
            key = self._parent[key]
        return key

    def union(self, a: Key, b: Key) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self._order[rb] < self._order[ra]:
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._members[ra] = sorted(
            self._members[ra] + self._members.pop(rb), key=self._order.__getitem__
        )

    def members(self, key: Key) -> list[Key]:
        """Members of ``key``'s set in insertion order."""
        return self._members[self.find(key)]

    def groups(self) -> list[list[Key]]:
        """Members of every set, sets and members in insertion order."""
        return sorted(self._members.values(), key=lambda m: self._order[m[0]])


def resolve_group_spec(members: Sequence[Key], specs: dict[Key, Spec]) -> ConcreteSpec:
    """The one spec a sharing group is quantized with; mixed dtypes are an error."""
    concrete = [
        (m, specs[m]) for m in members if m in specs and not isinstance(specs[m], SharedSpec)
    ]
    names = ", ".join(str(m) for m in members)
    if not concrete:
        raise QuantreeError(
            f"sharing group [{names}] has no QuantSpec, FixedSpec or DerivedSpec; "
            "give at least one of its members a concrete spec"
        )
    typed = [(m, d) for m in members if m in specs and (d := specs[m].dtype) is not None]
    if len({dtype for _, dtype in typed}) > 1:
        detail = ", ".join(f"{m}: {dtype.value}" for m, dtype in typed)
        raise QuantreeError(
            f"sharing group mixes dtypes ({detail}); members of a group share one set of "
            "parameters, so give them one dtype or remove the SharedSpec that joins them"
        )
    for kind in (FixedSpec, DerivedSpec):
        of_kind = [s for _, s in concrete if isinstance(s, kind)]
        if of_kind:
            if len(set(of_kind)) > 1:
                raise QuantreeError(
                    f"sharing group [{names}] has conflicting {kind.__name__}s {of_kind}; "
                    "give them equal parameters or do not share them"
                )
            return of_kind[0]
    return concrete[0][1]  # type: ignore[return-value]


def compatible(a: ConcreteSpec, b: ConcreteSpec) -> bool:
    """Whether two groups' specs describe one integer grid, so they may merge implicitly.

    Same dtype, quant range and axis, and a symmetric spec meets only zero point 0. Observer
    kind and power-of-two rounding are not compared: they choose how the one grid is
    calibrated, and the merged group's observer sees every member. Derived parameters are
    never merged implicitly: they follow their sources, not the tensors that read them.
    """
    if isinstance(a, DerivedSpec) or isinstance(b, DerivedSpec):
        return False
    if isinstance(a, FixedSpec) and isinstance(b, FixedSpec):
        return a == b
    if isinstance(a, FixedSpec) or isinstance(b, FixedSpec):
        fixed, calibrated = (a, b) if isinstance(a, FixedSpec) else (b, a)
        assert isinstance(fixed, FixedSpec) and isinstance(calibrated, QuantSpec)
        return (
            fixed.dtype == calibrated.dtype
            and fixed.range == calibrated.range
            and calibrated.axis is None
            and (fixed.zero_point == 0 or not calibrated.symmetric)
        )
    assert isinstance(a, QuantSpec) and isinstance(b, QuantSpec)
    return (a.dtype, a.symmetric, a.axis, a.range) == (b.dtype, b.symmetric, b.axis, b.range)


def may_merge(
    a: Sequence[Key], a_spec: ConcreteSpec, b: Sequence[Key], b_spec: ConcreteSpec
) -> bool:
    """Whether groups ``a`` and ``b`` may merge implicitly (a Value and a Use that reads it).

    A merged group with a FixedSpec is quantized with it, whatever its members' ranges. The
    Uses that read a fixed Value hold exactly that Value's tensor, so they may join it; a
    Value reaching the fixed group from the other side (a ``cat`` output, the state an LSTM
    returns for a ``tanh`` initial state) may hold a wider range and would be clipped. Such a
    merge is refused and the edge is requantized instead; an explicit ``SharedSpec`` still
    joins anything.
    """
    if not compatible(a_spec, b_spec):
        return False
    return not (_gains_fixed(a, a_spec, b_spec) or _gains_fixed(b, b_spec, a_spec))


def _gains_fixed(members: Sequence[Key], spec: ConcreteSpec, other: ConcreteSpec) -> bool:
    """Whether a merge would put Values of ``members`` on ``other``'s fixed grid."""
    newly_fixed = isinstance(other, FixedSpec) and not isinstance(spec, FixedSpec)
    return newly_fixed and any(isinstance(m, Value) for m in members)


@dataclass(frozen=True)
class Group:
    """A sharing group as prepare leaves it; ``qparams`` is set by convert.

    Groups live in ``gm.meta``, so they hold no graph nodes: members are labels, and a
    derived group names the groups it derives from by id.
    """

    id: int
    spec: GroupSpec
    members: tuple[str, ...]
    observer: str | None = None
    derived_from: tuple[int, ...] = ()
    qparams: QParams | None = None

    @property
    def label(self) -> str:
        shown = ", ".join(self.members[:4])
        more = f" and {len(self.members) - 4} more" if len(self.members) > 4 else ""
        return f"group {self.id} ({shown}{more})"


def labels(keys: Iterable[Key]) -> tuple[str, ...]:
    return tuple(str(k) for k in keys)
