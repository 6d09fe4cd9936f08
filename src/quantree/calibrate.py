"""calibrate: run a prepared model over data so its observers collect statistics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from tqdm.auto import tqdm


def as_args(batch: Any) -> tuple[Any, ...]:
    """A calibration item is an argument tuple; a lone tensor stands for ``(tensor,)``."""
    return tuple(batch) if isinstance(batch, tuple | list) else (batch,)


def calibrate(prepared: torch.nn.Module, data: Iterable[Any], *, progress: bool = True) -> int:
    """Feed every batch of ``data`` to ``prepared``; returns the number of batches."""
    count = 0
    total = len(data) if hasattr(data, "__len__") else None  # type: ignore[arg-type]
    with torch.no_grad():
        for batch in tqdm(data, total=total, desc="calibrating", disable=not progress, leave=False):
            prepared(*as_args(batch))
            count += 1
    return count
