"""Facts recorded about a constant tensor, kept on its storage rather than on the tensor.

A backend may record how it derived a constant (``backends/cpu/derived.py``: the recipe
``save`` writes instead of the tensor). An attribute of the tensor would do, but
``torch.save`` pickles a tensor's attributes with it: a lowered model's ``state_dict`` would
then no longer save, or no longer load with ``weights_only=True``. A storage's Python object
lives as long as its data and ``torch.save`` writes only its bytes, so the facts are kept
there, per view (offset, shape, strides, dtype), and nothing is global. Passes that replace
a constant by an equal one (``share_identical``) carry its facts over (:func:`carry`); a
deep copy has new storages and starts without them.
"""

from __future__ import annotations

from typing import Any

import torch

_NOTES = "_quantree_notes"


def _view(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def note(t: torch.Tensor, name: str, value: Any) -> None:
    """Record ``name = value`` about ``t`` for as long as its storage lives."""
    storage = t.untyped_storage()
    table = getattr(storage, _NOTES, None)
    if table is None:
        table = {}
        setattr(storage, _NOTES, table)
    table.setdefault(_view(t), {})[name] = value


def notes(t: object) -> dict[str, Any]:
    """What was recorded about ``t`` (empty if nothing, or if ``t`` is not a tensor)."""
    if not isinstance(t, torch.Tensor):
        return {}
    table = getattr(t.untyped_storage(), _NOTES, None) or {}
    return dict(table.get(_view(t), {}))


def carry(kept: torch.Tensor, dropped: torch.Tensor) -> None:
    """Give ``kept`` what was recorded about ``dropped`` and not about it (an equal tensor
    standing in for ``dropped``)."""
    have = notes(kept)
    for name, value in notes(dropped).items():
        if name not in have:
            note(kept, name, value)
