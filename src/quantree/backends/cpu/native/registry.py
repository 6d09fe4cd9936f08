"""The ``quantree`` op library: where ``torch.ops.quantree.*`` are defined.

Each op is defined with a schema on a ``torch.library.Library`` fragment, with a CPU kernel
and ``torch.library.register_fake``. ``torch.library.custom_op`` would do the same with less
text, but its Python wrapper costs several times what a call costs here, which would be
most of the time of a small int8 layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])
LIBRARY = torch.library.Library("quantree", "FRAGMENT")


def op(schema: str) -> Callable[[F], F]:
    """Define ``torch.ops.quantree.<name>`` from ``schema``, implemented by the function."""

    def register(fn: F) -> F:
        LIBRARY.define(schema)
        LIBRARY.impl(schema.split("(")[0], fn, "CPU")
        return fn

    return register


def inverse(scale: float) -> float:
    """1 / scale; 0 for the "float output" marker scale 0."""
    return 1.0 / scale if scale > 0 else 0.0


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, or left channels-last if it is a channels-last 4-d tensor."""
    channels_last = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    return t if channels_last else t.contiguous()
