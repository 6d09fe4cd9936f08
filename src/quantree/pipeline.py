"""quantize: the whole pipeline, capture -> prepare -> calibrate -> convert -> lower."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

from quantree.capturing import capture
from quantree.core.calibrate import calibrate
from quantree.core.convert import Unobserved, convert
from quantree.core.lower import REFERENCE, Backend, lower
from quantree.core.prepare import prepare
from quantree.core.quantizer import Quantizer
from quantree.recipes import Int8Quantizer


def quantize(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    calibration: Iterable[Any],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
    quantizer: Quantizer | None = None,
    backend: Backend = REFERENCE,
    progress: bool = True,
    unobserved: Unobserved = Unobserved.ERROR,
) -> fx.GraphModule:
    """Quantize ``model`` in one call.

    ``example_kwargs`` and ``dynamic_shapes`` go to :func:`quantree.capture` (so to
    ``torch.export``): without ``dynamic_shapes`` the first dimension of each input varies
    where the model allows it (``dynamic_batch=False`` fixes every dimension).
    ``calibration`` is any iterable of argument tuples, or of ``(args, kwargs)`` pairs for
    a model captured with ``example_kwargs``. ``unobserved`` says what becomes of tensors
    calibration never saw (an error naming them, or float with one warning).
    """
    captured = capture(
        model,
        example_args,
        example_kwargs,
        dynamic_shapes=dynamic_shapes,
        dynamic_batch=dynamic_batch,
    )
    prepared = prepare(captured, quantizer or Int8Quantizer())
    calibrate(prepared, calibration, progress=progress)
    return lower(convert(prepared, unobserved=unobserved), backend)
