"""A quantized, lowered or loaded model refuses pickling (``torch.save(model)``) with the way
to save it.

A lowered graph calls quantree's native ops, which pickle cannot name (fx writes each call's
import): ``torch.save`` failed deep inside ``torch.package`` with an ``ObjNotFoundError``; a
reference graph (``torch.export``'s module, its input checks) with a raw ``AttributeError``.
A ``.pt2`` archive from ``quantree.backends.save`` is the format that loads back safely
(``load`` reads it as untrusted data; a pickle would run code when loaded).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from quantree.core.errors import QuantreeError

HOW_TO_SAVE = (
    "a model quantree quantized, lowered or loaded is not pickled (torch.save(model), "
    "pickle): its graph calls torch.export's and quantree's ops by reference. Save it with "
    "quantree.backends.save(model, 'model.pt2', example_args) and read it back with "
    "quantree.backends.load('model.pt2'); or save the float model's state_dict and quantize "
    "again"
)


def _refuse(self: Any, protocol: int = 2) -> NoReturn:
    raise QuantreeError(HOW_TO_SAVE)


def refuse_pickling(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` (its class is its own: fx makes one per GraphModule) with pickling refused."""
    cls = type(module)
    cls.__reduce_ex__ = _refuse  # type: ignore[method-assign,assignment]
    cls.__reduce__ = _refuse  # type: ignore[method-assign,assignment]
    return module
