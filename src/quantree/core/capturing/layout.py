"""A batch whose dimensions are the captured example's in another order: say so.

Channels-last images, time-major sequences or a mel spectrogram given as (batch, time, mels)
to a model captured with (batch, mels, time) fail the program's shape guard. Freeing those
dimensions with ``dynamic_shapes`` cannot work (the model's weights fix the channel count,
and capture then fails), so where a batch's sizes are the captured ones permuted, the fix
named is the permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

Shape = Sequence[int | None]
"""A captured shape: ``None`` where the dimension was left dynamic."""


def permuted_order(got: Sequence[int], captured: Shape) -> tuple[int, ...] | None:
    """``order`` with ``got[order[i]]`` matching ``captured[i]``, if ``got`` is ``captured``
    in another order (a dynamic dimension matches the same position); else None."""
    if len(got) != len(captured) or list(got) == list(captured):
        return None
    order: list[int | None] = [i if size is None else None for i, size in enumerate(captured)]
    free = [j for j in range(len(got)) if j not in order]
    for i, size in enumerate(captured):
        if size is None:
            continue
        same = [j for j in free if got[j] == size]
        if not same:
            return None
        pick = i if i in same else same[0]  # keep a dimension in place where it fits there
        order[i] = pick
        free.remove(pick)
    done = tuple(j for j in order if j is not None)
    return None if done == tuple(range(len(got))) else done


def layout_fix(name: str, got: Sequence[int], captured: Shape, code: str = "") -> str | None:
    """The permutation to apply to ``name`` (``code`` in Python), as a fix, if it is permuted."""
    order = permuted_order(got, captured)
    if order is None:
        return None
    shown = "(" + ", ".join("*" if d is None else str(d) for d in captured) + ")"
    return (
        f"{name} has the captured sizes in another order (captured {shown}, got "
        f"{tuple(got)}): give it in the captured layout, e.g. {code or name}.permute{order}; "
        "dynamic_shapes cannot free a size the model's layers fix"
    )


CHANNEL_NOTE = (
    "; a size the model's layers fix (channels, features) cannot be made dynamic: give "
    "batches with the captured size there"
)
"""Appended to a ``dynamic_shapes`` fix for a dimension other than the batch's."""
