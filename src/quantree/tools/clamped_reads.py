"""The interval every reader of a tensor keeps, for the rows of ``compare``.

Where every op that reads a tensor clamps it (a ReLU after a residual add, a ReLU6 after a
convolution), the default recipe calibrates the tensor's grid on the clamped values
(``QuantSpec.clamped``): the values the readers discard are not on the grid, and no op ever
sees them. Comparing the tensor with the float one before the clamp would count those
discarded values as error (a residual sum read only by a ReLU showed 2.8 dB while every op
after it was above 36 dB), so such a row compares what the readers see: both tensors
clamped to the interval.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.fx as fx

from quantree.core.observing.observers import Observer
from quantree.recipes.int8 import kept_interval


def _readers(gm: fx.GraphModule, node: fx.Node) -> Iterator[fx.Node]:
    """The ops reading ``node``, seen through the observers of a prepared graph (the
    identity, placed between the tensor and its readers)."""
    for user in node.users:
        if user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)), Observer):
            yield from _readers(gm, user)
        else:
            yield user


def read_interval(gm: fx.GraphModule, node: fx.Node) -> tuple[float, float] | None:
    """The smallest interval holding what each reader of ``node`` keeps, when every reader
    clamps it; None when one reader does not (it sees the whole tensor) or there is none."""
    kept = [kept_interval(reader) for reader in _readers(gm, node)]
    if not kept:
        return None
    if any(k is None for k in kept):
        return None
    lows, highs = zip(*(k for k in kept if k is not None), strict=True)
    return min(lows), max(highs)
