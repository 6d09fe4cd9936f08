"""quantize: the whole pipeline, capture -> prepare -> calibrate -> convert -> lower."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from quantree.backend import REFERENCE, Backend, lower
from quantree.calibrate import calibrate
from quantree.capture import capture
from quantree.convert import convert
from quantree.int8 import Int8Quantizer
from quantree.prepare import prepare
from quantree.quantizer import Quantizer


def quantize(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    calibration: Iterable[Any],
    *,
    quantizer: Quantizer | None = None,
    backend: Backend = REFERENCE,
    progress: bool = True,
) -> fx.GraphModule:
    """Quantize ``model`` in one call; ``calibration`` is any iterable of argument tuples."""
    prepared = prepare(capture(model, example_args), quantizer or Int8Quantizer())
    calibrate(prepared, calibration, progress=progress)
    return lower(convert(prepared), backend)
