"""Backends: values that say how a reference q/dq graph becomes real kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class Backend:
    """An ordered set of lowering rules; the reference backend has none."""

    name: str
    rules: tuple[object, ...] = ()


REFERENCE = Backend("reference")


def lower(ref: fx.GraphModule, backend: Backend = REFERENCE) -> fx.GraphModule:
    return ref
