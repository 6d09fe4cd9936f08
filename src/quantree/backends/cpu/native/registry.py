"""The ``quantree`` op library: where ``torch.ops.quantree.*`` are defined.

Each op is defined with a schema on a ``torch.library.Library`` fragment, with a CPU kernel
and ``torch.library.register_fake``. ``torch.library.custom_op`` would do the same with less
text, but its Python wrapper costs several times what a call costs here, which would be
most of the time of a small int8 layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from quantree.backends.cpu.native.checks import fail
from quantree.core.errors import QuantreeError

F = TypeVar("F", bound=Callable[..., Any])
LIBRARY = torch.library.Library("quantree", "FRAGMENT")


def op(schema: str) -> Callable[[F], F]:
    """Define ``torch.ops.quantree.<name>`` from ``schema``, implemented by the function."""

    def register(fn: F) -> F:
        name = schema.split("(")[0]
        checked = contract_errors(name, fn)
        LIBRARY.define(schema)
        LIBRARY.impl(name, checked, "CPU")
        return checked

    return register


RAW = (ZeroDivisionError, IndexError, KeyError, ValueError, TypeError, OverflowError,
       RuntimeError)  # fmt: skip
"""What an op's Python body raises on arguments its contract did not foresee (a scale of 0,
a 1-d activation indexed as 2-d, a list one item short, torch refusing a reshape)."""


def contracted(name: str) -> Callable[[F], F]:
    """``contract_errors`` as a decorator: for an op's per-node implementations (a runner's
    methods, which a lowered graph calls without the dispatcher)."""
    return lambda fn: contract_errors(name, fn)


def contract_errors(name: str, fn: F) -> F:
    """``fn`` raising ``NativeArgumentError`` (naming the op) where its body would raise a
    raw Python or torch error: the net under every op's own contract (``native_checks``),
    which names the argument where it foresees the case. An op is called with arguments
    from files, and a crafted one must meet the same error as every other bad argument."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except QuantreeError:
            raise
        except RAW as error:
            raise fail(name, f"an argument is out of range ({type(error).__name__}: "
                       f"{str(error)[:300]})") from error  # fmt: skip

    return checked  # type: ignore[return-value]


def inverse(scale: float) -> float:
    """1 / scale; 0 for the "float output" marker scale 0."""
    return 1.0 / scale if scale > 0 else 0.0


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, or left channels-last if it is a channels-last 4-d tensor."""
    channels_last = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    return t if channels_last else t.contiguous()
