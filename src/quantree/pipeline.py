"""quantize: the whole pipeline, capture -> prepare -> calibrate -> convert -> lower."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

import quantree.core.lower as core_lower
from quantree.backends.cpu.saved.pickling import refuse_pickling
from quantree.backends.fastest import attach_reference
from quantree.core.calibrate import calibrate, check_calibration_data
from quantree.core.convert import Unobserved, convert
from quantree.core.errors import QuantreeError
from quantree.core.lower import REFERENCE, Backend
from quantree.core.observing.distributed import in_process_group
from quantree.core.prepare import prepare as core_prepare
from quantree.core.quantizer import Quantizer
from quantree.core.refining.refine import Refine
from quantree.core.refining.refine import refine as refine_weights
from quantree.core.stages import TRAINED_KEY
from quantree.core.training.qat import prepare_qat as core_prepare_qat
from quantree.recipes.activation_points import transformer_like
from quantree.recipes.int8 import Int8Quantizer
from quantree.recipes.pt2e import as_quantizer, is_pt2e_quantizer
from quantree.recurrent.capture import capture
from quantree.recurrent.unrolled.fold import is_cell_step
from quantree.recurrent.unrolled.step_loop import StepLoop
from quantree.tools.mixed_precision import META_KEY, mixed_precision

BACKEND_NAMES = ("auto", "reference", "cpu")
"""``auto``: the fastest backend this machine runs (``quantree.backends.fastest``)."""

AUTO_REFINE = "auto"
"""``quantize``'s default ``refine``: ``Refine()`` where :func:`auto_refine` says it pays."""


def auto_refine(captured: fx.GraphModule, calibration: Iterable[Any]) -> Refine | None:
    """``Refine()`` for a transformer-like graph (``recipes.activation_points.transformer_like``)
    calibrated on a collection in one process; None elsewhere.

    There the recipe quantizes only what weights read, on int16 inputs, so the int8
    weights' rounding is most of the error left, and that is what refine re-chooses; the
    layers are linears, whose statistics are a few ``in x in`` sums, so it costs about one
    more calibration pass. On a CNN the int8 activations are the larger error and a
    convolution's patches make its statistics costly (many times the quantize time), so
    refine stays opt-in there.
    An iterator cannot be run twice, and a process's shard would give each process its own
    integers (refine does not merge across processes): neither is refined by default.
    (Figures: benchmarks/README.md, "h-zoo27".)"""
    if iter(calibration) is calibration or in_process_group():  # type: ignore[comparison-overlap]
        return None
    return Refine() if transformer_like(captured.graph) else None


def resolve_backend(backend: Backend | str | None) -> Backend:
    """A Backend, None (the reference), or one named as the command line names them."""
    if isinstance(backend, Backend):
        return backend
    if backend is None or backend == "reference":
        return REFERENCE
    if backend == "auto":
        from quantree.backends.fastest import fastest_backend

        return fastest_backend()
    if backend == "cpu":
        from quantree.backends import CPU

        return CPU
    shown = repr(backend)[:60] if isinstance(backend, str) else "object"
    raise QuantreeError(
        f"backend must be a Backend (quantree.REFERENCE, quantree.backends.CPU), None (the "
        f"reference graph) or one of the names {', '.join(map(repr, BACKEND_NAMES))}, "
        f"got {type(backend).__name__} {shown}"
    )


def prepare(gm: fx.GraphModule, quantizer: Quantizer | Any) -> fx.GraphModule:
    """A copy of ``gm`` with observers, ready to calibrate (``quantree.core.prepare``).

    ``quantizer`` is a quantree ``Quantizer`` or a pt2e one (torchao's ``Quantizer``: its
    annotations are translated, see ``quantree.recipes.pt2e``).
    """
    return core_prepare(gm, as_quantizer(quantizer), stacklevel=3)


def prepare_qat(
    gm: fx.GraphModule,
    quantizer: Quantizer | Any,
    calibration: Iterable[Any] | None = None,
    *,
    learn_scales: bool = True,
    progress: bool = False,
) -> fx.GraphModule:
    """A trainable copy of ``gm`` with learned fake quantization (``quantree.core.training``).

    ``quantizer`` as :func:`prepare` takes it (a pt2e one too); ``calibration`` initialises
    the ranges (or calibrate the returned model before training; see docs/qat.md);
    ``quantree.convert`` of the trained model gives the reference graph.
    """
    return core_prepare_qat(
        gm,
        as_quantizer(quantizer),
        calibration,
        learn_scales=learn_scales,
        progress=progress,
        stacklevel=3,
    )


def lower(ref: fx.GraphModule, backend: Backend | str | None = REFERENCE) -> fx.GraphModule:
    """``quantree.core.lower.lower`` with a backend given as a Backend or by name.

    The lowered model keeps ``ref`` (``quantree.backends.fastest.reference_of``), so what
    reads only q/dq graphs, ONNX export, takes it as well. A reference converted from a QAT
    model, lowered by name (``"cpu"``, ``"auto"``), feeds recurrent states back as int16
    (``cpu_backend(hidden_bits=16)``): it was trained with them fed back in float, and int8
    feedback moved its outputs by two steps where int16 stays within one (docs/qat.md).
    """
    chosen = resolve_backend(backend)
    if isinstance(backend, str) and ref.meta.get(TRAINED_KEY):
        from quantree.backends import CPU, cpu_backend

        if chosen is CPU:
            chosen = cpu_backend(hidden_bits=16)
    return attach_reference(core_lower.lower(ref, chosen), ref)


def quantize(
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    calibration: Iterable[Any],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    dynamic_batch: bool = True,
    quantizer: Quantizer | None = None,
    backend: Backend | str | None = "auto",
    progress: bool = True,
    unobserved: Unobserved = Unobserved.ERROR,
    fold_loops: bool | None = None,
    refine: Refine | str | None = AUTO_REFINE,
    target_sqnr: float | None = None,
) -> fx.GraphModule:
    """Quantize ``model`` in one call.

    ``example_kwargs`` and ``dynamic_shapes`` go to :func:`quantree.capture` (so to
    ``torch.export``): without ``dynamic_shapes`` the first dimension of each input varies
    where the model allows it (``dynamic_batch=False`` fixes every dimension).
    ``calibration`` is any iterable of argument tuples, or of ``(args, kwargs)`` pairs for
    a model captured with ``example_kwargs``; in a ``torch.distributed`` process group, this
    process's shard of them (see :func:`quantree.calibrate`). ``backend`` is a Backend or its name:
    by default (``'auto'``) the fastest this machine runs, the CPU backend where its kernels
    load (the reference graph, with one warning, where they cannot); ``None`` or
    ``'reference'`` the q/dq reference graph; ``'cpu'`` the CPU backend. A lowered model keeps
    the reference graph it came from, so ``qt.export_onnx`` takes either. ``unobserved`` says
    what becomes of tensors calibration never saw (an error naming them, or float with one
    warning). ``fold_loops`` (as for :func:`quantree.capture`) folds a Python loop over time
    that export unrolled back into one loop (by default where its step is a recurrent cell;
    ``True`` also frees a loop over chunks of its captured length).
    ``refine`` (a :class:`quantree.Refine`)
    re-chooses weight integers and biases after convert (:func:`quantree.refine`; it runs
    ``calibration`` a second time, so that must be a collection, not an iterator); by default
    (``'auto'``) ``Refine()`` on transformer-like graphs (:func:`auto_refine`), ``None``
    never. Every
    argument is checked before the model is
    captured. ``target_sqnr`` (dB) widens the fewest points to int16 or float to meet it on
    held-out calibration batches (:func:`quantree.mixed_precision`, whose result the model's
    ``meta["quantree_mixed_precision"]`` holds); it takes argument tuples only.
    """
    if refine != AUTO_REFINE and not (refine is None or isinstance(refine, Refine)):
        raise QuantreeError(
            f"refine must be a quantree.Refine, None or {AUTO_REFINE!r}, got "
            f"{type(refine).__name__}"
        )
    explicit = refine if isinstance(refine, Refine) else None
    if target_sqnr is not None:
        if example_kwargs or dynamic_shapes is not None or explicit is not None or fold_loops:
            raise QuantreeError(
                "target_sqnr works with positional example_args and calibration tuples, "
                "without example_kwargs, dynamic_shapes, refine or fold_loops; call "
                "quantree.mixed_precision and quantree.lower yourself for more"
            )
        chosen = mixed_precision(
            model, example_args, calibration, target_sqnr=target_sqnr, quantizer=quantizer
        )
        lowered = attach_reference(
            core_lower.lower(chosen.reference, resolve_backend(backend)), chosen.reference
        )
        if isinstance(lowered, fx.GraphModule):
            lowered.meta[META_KEY] = chosen
        return refuse_pickling(lowered)
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
    if explicit is not None and iter(calibration) is calibration:
        raise QuantreeError(
            "refine runs calibration a second time: pass a collection it can run again "
            "(a list of batches, not an iterator)"
        )
    if not isinstance(unobserved, Unobserved):
        raise QuantreeError(f"unobserved must be a quantree.Unobserved, got {unobserved!r}")

    def quantized(
        fold: bool | None, free_chunks: bool | None = None
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        captured = capture(
            model,
            example_args,
            example_kwargs,
            dynamic_shapes=dynamic_shapes,
            dynamic_batch=dynamic_batch,
            fold_loops=fold,
            free_chunks=free_chunks,
        )
        prepared = prepare(captured, quantizer or Int8Quantizer())
        calibrate(prepared, calibration, progress=progress)
        reference = convert(prepared, unobserved=unobserved)
        chosen = auto_refine(captured, calibration) if refine == AUTO_REFINE else explicit
        if chosen is not None:
            reference = refine_weights(prepared, reference, calibration, chosen)
        lowered = attach_reference(core_lower.lower(reference, resolved), reference)
        return captured, refuse_pickling(lowered)

    # by default every Python loop over time is folded where its lowered step runs natively
    # (quantree.recurrent.unrolled): tried folded, kept unrolled where a step would run op by
    # op in Python. Calibration runs twice then, so only a collection of batches is tried.
    trial = fold_loops is None and resolved is not REFERENCE
    trial = trial and iter(calibration) is not calibration
    if not trial:
        return quantized(fold_loops)[1]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            captured, lowered = quantized(True, free_chunks=False)  # the default's speed
        except Exception:  # whatever fails folded is said by the default's own run
            return quantized(None)[1]
    if not any(isinstance(m, StepLoop) and not is_cell_step(m) for m in captured.modules()):
        _say(said)  # no loop but cell loops: what the default folds anyway
        return lowered
    if any(isinstance(m, StepLoop) for m in lowered.modules()):  # a step left in Python
        return quantized(None)[1]
    _say(said)
    return lowered


def _say(said: list[warnings.WarningMessage]) -> None:
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


__all__ = [
    "AUTO_REFINE",
    "BACKEND_NAMES",
    "auto_refine",
    "lower",
    "prepare",
    "prepare_qat",
    "quantize",
    "resolve_backend",
]
