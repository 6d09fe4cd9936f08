"""Facts recorded about a constant tensor, kept beside it rather than on it.

A backend may record how it derived a constant (``backends/cpu/derived.py``: the recipe
``save`` writes instead of the tensor). An attribute on the tensor object would do, but
``torch.save`` pickles a tensor's attributes with it: a lowered model's ``state_dict`` would
then no longer save, or no longer load with ``weights_only=True``. So the facts live in a
table keyed by the tensor's identity, dropped when the tensor is freed. Passes that replace
a constant by an equal one (``share_identical``) carry its facts over (:func:`carry`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_TABLE: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _TABLE.get(key)
    if entry is not None and entry[0] is ref:
        del _TABLE[key]


def annotate(t: torch.Tensor, name: str, value: Any) -> None:
    """Record ``name = value`` about ``t`` for as long as ``t`` lives."""
    key = id(t)
    entry = _TABLE.get(key)
    if entry is None or entry[0]() is not t:

        def forget(ref: weakref.ref) -> None:
            _forget(key, ref)

        ref = weakref.ref(t, forget)
        entry = (ref, {})
        _TABLE[key] = entry
    entry[1][name] = value


def notes(t: object) -> dict[str, Any]:
    """What was recorded about ``t`` (empty if nothing, or if ``t`` is not a tensor)."""
    entry = _TABLE.get(id(t)) if isinstance(t, torch.Tensor) else None
    return dict(entry[1]) if entry is not None and entry[0]() is t else {}


def carry(kept: torch.Tensor, dropped: torch.Tensor) -> None:
    """Give ``kept`` what was recorded about ``dropped`` and not about it (an equal tensor
    standing in for ``dropped``)."""
    have = notes(kept)
    for name, value in notes(dropped).items():
        if name not in have:
            annotate(kept, name, value)
