"""keyword_inputs: a ``forward(self, x, **kwargs)`` exported with dynamic shapes.

torch.export (2.13) cannot take ``dynamic_shapes`` for a model whose ``**kwargs`` receives
arguments: it checks the spec against the signature's parameters (``x``, ``kwargs``) but
later matches it against those parameters plus every keyword again (``x``, ``kwargs``,
``y``, ``z``), so every spec is refused ("Must provide a tree_name when there might be a
mismatch") and the batch could only be captured fixed. Exporting a view of the model whose
``forward`` names those keywords as keyword-only parameters makes both matches agree; the
program is the same (same keywords, same in-spec, same parameter names), and the view shares
every parameter, buffer and submodule with the model (a shallow copy with its own
``forward``), so nothing of the model is copied or changed.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch


def _var_keyword(signature: inspect.Signature) -> inspect.Parameter | None:
    return next(
        (p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD),
        None,
    )


def named_keywords(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``model``, or a view of it whose ``forward`` takes the keywords its ``**kwargs``
    would collect as named parameters (when it has ``**kwargs`` and they collect any)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return model
    collector = _var_keyword(signature)
    named = set(signature.parameters) - {collector.name if collector else ""}
    collected = [k for k in kwargs if k not in named]
    if collector is None or not collected:
        return model
    kept = [p for p in signature.parameters.values() if p is not collector]
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in collected]
    # keyword-only parameters must come after *args and before nothing positional
    positional = [p for p in kept if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword_only = [p for p in kept if p.kind is inspect.Parameter.KEYWORD_ONLY]
    forward = model.forward
    view = copy.copy(model)
    object.__setattr__(
        view, "forward", _with_signature(forward, [*positional, *keyword_only, *extra])
    )
    return view


def _with_signature(
    forward: Callable[..., Any], parameters: list[inspect.Parameter]
) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    call.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return call


def respelled_shapes(model: torch.nn.Module, view: torch.nn.Module, dynamic_shapes: Any) -> Any:
    """The user's ``dynamic_shapes`` for ``model`` as ``view`` (from ``named_keywords``)
    names its parameters: a dict entry for the ``**kwargs`` parameter, ``{"kwargs": {"y":
    spec}}``, becomes ``{"y": spec}``; anything else is returned as it is."""
    if view is model or not isinstance(dynamic_shapes, dict):
        return dynamic_shapes
    collector = _var_keyword(inspect.signature(model.forward))
    inner = dynamic_shapes.get(collector.name) if collector else None
    if collector is None or not isinstance(inner, dict):
        return dynamic_shapes
    named = {k: v for k, v in dynamic_shapes.items() if k != collector.name}
    return named | inner
