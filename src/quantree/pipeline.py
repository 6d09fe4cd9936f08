"""quantize: the whole pipeline, capture -> prepare -> calibrate -> convert -> lower."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

import quantree.core.lower as core_lower
from quantree.core.calibrate import calibrate, check_calibration_data
from quantree.core.convert import Unobserved, convert
from quantree.core.errors import QuantreeError
from quantree.core.lower import REFERENCE, Backend
from quantree.core.observing.distributed import in_process_group
from quantree.core.prepare import prepare as core_prepare
from quantree.core.quantizer import Quantizer
from quantree.recipes.int8 import Int8Quantizer
from quantree.recipes.pt2e import as_quantizer, is_pt2e_quantizer
from quantree.recurrent.capture import capture

BACKEND_NAMES = ("reference", "cpu")


def resolve_backend(backend: Backend | str) -> Backend:
    """A Backend, or one named as the command line names them ('reference', 'cpu')."""
    if isinstance(backend, Backend):
        return backend
    if backend == "reference":
        return REFERENCE
    if backend == "cpu":
        from quantree.backends import CPU

        return CPU
    shown = repr(backend)[:60] if isinstance(backend, str) else "object"
    raise QuantreeError(
        f"backend must be a Backend (quantree.REFERENCE, quantree.backends.CPU) or one of the "
        f"names {', '.join(map(repr, BACKEND_NAMES))}, got {type(backend).__name__} {shown}"
    )


def prepare(gm: fx.GraphModule, quantizer: Quantizer | Any) -> fx.GraphModule:
    """A copy of ``gm`` with observers, ready to calibrate (``quantree.core.prepare``).

    ``quantizer`` is a quantree ``Quantizer`` or a pt2e one (torchao's ``Quantizer``: its
    annotations are translated, see ``quantree.recipes.pt2e``).
    """
    return core_prepare(gm, as_quantizer(quantizer), stacklevel=3)


def lower(ref: fx.GraphModule, backend: Backend | str = REFERENCE) -> fx.GraphModule:
    """``quantree.core.lower.lower`` with a backend given as a Backend or by name."""
    return core_lower.lower(ref, resolve_backend(backend))


def quantize(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    calibration: Iterable[Any],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
    quantizer: Quantizer | None = None,
    backend: Backend | str = REFERENCE,
    progress: bool = True,
    unobserved: Unobserved = Unobserved.ERROR,
) -> fx.GraphModule:
    """Quantize ``model`` in one call.

    ``example_kwargs`` and ``dynamic_shapes`` go to :func:`quantree.capture` (so to
    ``torch.export``): without ``dynamic_shapes`` the first dimension of each input varies
    where the model allows it (``dynamic_batch=False`` fixes every dimension).
    ``calibration`` is any iterable of argument tuples, or of ``(args, kwargs)`` pairs for
    a model captured with ``example_kwargs``; in a ``torch.distributed`` process group, this
    process's shard of them (see :func:`quantree.calibrate`). ``backend`` is a Backend or its name,
    ``'reference'`` or ``'cpu'``. ``unobserved`` says what becomes of tensors calibration
    never saw (an error naming them, or float with one warning). Every argument is checked
    before the model is captured.
    """
    resolved = resolve_backend(backend)
    # in a process group a shard may be empty; calibrate checks that some process had data
    check_calibration_data(calibration, allow_empty=in_process_group())
    if quantizer is not None and not (
        isinstance(quantizer, Quantizer) or is_pt2e_quantizer(quantizer)
    ):
        raise QuantreeError(
            f"quantizer must be a Quantizer (e.g. quantree.Int8Quantizer()) or a pt2e "
            f"Quantizer, got {type(quantizer).__name__}"
        )
    if not isinstance(unobserved, Unobserved):
        raise QuantreeError(f"unobserved must be a quantree.Unobserved, got {unobserved!r}")
    captured = capture(
        model,
        example_args,
        example_kwargs,
        dynamic_shapes=dynamic_shapes,
        dynamic_batch=dynamic_batch,
    )
    prepared = prepare(captured, quantizer or Int8Quantizer())
    calibrate(prepared, calibration, progress=progress)
    return core_lower.lower(convert(prepared, unobserved=unobserved), resolved)


__all__ = ["BACKEND_NAMES", "lower", "prepare", "quantize", "resolve_backend"]
