"""w4a8: 4-bit per-channel (or per-group) weights, int8 activations, int32 biases.

Weights are expressed as pt2e expresses 4-bit integers: int8 storage with
``quant_min=-8, quant_max=7`` on the weight's quantize/dequantize pair, so the reference
graph is plain pt2e dialect, the CPU backend's int8 kernels compute on the values exactly
(the same kernels, so no slower than int8), and only the saved file packs two weights a byte
(``backends/cpu/saved/nibbles.py``). Everything else is the int8 recipe's.

``group_size`` gives each group of input columns its own 4-bit step, an integer multiple of
the channel's int8 scale (``core/observing/grouped.py``): still int8 integers to the kernels.

Embedding tables stay at int8 (``embedding_bits=8``): a table is read by lookup, not by a
matmul, so 4 bits save little time; on the char-LM its 4-bit table was most of the w4a8
recipe's loss. ``embedding_bits=4`` quantizes it to 4 bits too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError
from quantree.core.observing.grouped import GRID_MAX, GRID_MIN, check_group_size
from quantree.core.quantizer import Annotation, Rule
from quantree.core.specs import ObserverKind, QDtype, QuantSpec, int8_weight
from quantree.recipes.float_only import on_floats
from quantree.recipes.int8 import Int8Quantizer

INT4_MIN, INT4_MAX = -8, 7


def int4_weight(axis: int | None = 0, observer: ObserverKind = ObserverKind.MINMAX) -> QuantSpec:
    """Symmetric 4-bit weights in int8 storage on [-8, 7] (pt2e's int4 convention): the
    scale maps the largest magnitude to 7.5, so both ends of the grid are used."""
    return QuantSpec(
        QDtype.INT8,
        symmetric=True,
        axis=axis,
        observer=observer,
        quant_min=INT4_MIN,
        quant_max=INT4_MAX,
    )


def grouped_int4_weight(group_size: int, observer: ObserverKind = ObserverKind.MINMAX) -> QuantSpec:
    """4-bit weights with a scale per ``group_size`` input columns, on the channel's int8
    grid (``quantree.core.observing.grouped``): the scale maps the largest magnitude to 127.5
    and each group takes 1-16 times it."""
    return QuantSpec(
        QDtype.INT8,
        symmetric=True,
        axis=0,
        observer=observer,
        quant_min=GRID_MIN,
        quant_max=GRID_MAX,
        group_size=group_size,
    )


def embedding_rule(weight: QuantSpec) -> Rule:
    """An embedding's table on ``weight``'s grid (its output is the table's rows)."""

    def annotate(node: fx.Node) -> Annotation:
        return Annotation(outputs=None, inputs={(0,): weight})

    return on_floats(Rule((torch.ops.aten.embedding,), annotate))


class W4A8Quantizer(Int8Quantizer):
    """4-bit per-channel weights (linear, conv, recurrent W_ih/W_hh) and int8 activations.

    Takes every option of :class:`Int8Quantizer`; ``weight_observer`` and ``per_channel``
    shape the 4-bit weight spec (``ObserverKind.SEARCH`` picks each channel's clip by its
    exact error on the 4-bit grid; ``qt.refine`` then re-rounds on that grid).
    ``embedding_bits`` (8 or 4) is the embedding tables' width. ``group_size`` (e.g. 32):
    a 4-bit scale per that many input columns of each output channel instead of one per
    channel, each an integer multiple (1-16) of the channel's int8 scale, so the lowered model
    still runs the int8 kernels (``quantree.core.observing.grouped``); every weight's input
    columns (a convolution's ``in * kh * kw``) must split into whole groups. A ``weight``
    spec given explicitly replaces the 4-bit one.
    """

    def __init__(
        self, *, embedding_bits: int = 8, group_size: int | None = None, **options: Any
    ) -> None:
        if embedding_bits not in (4, 8):
            raise QuantreeError(f"embedding_bits must be 4 or 8, got {embedding_bits!r}")
        observer = options.get("weight_observer", ObserverKind.MINMAX)
        if not isinstance(observer, ObserverKind):
            raise QuantreeError(f"weight_observer must be an ObserverKind, got {observer!r}")
        check_group_size(group_size)
        axis = 0 if options.get("per_channel", True) else None
        if group_size is not None and axis is None:
            raise QuantreeError(
                "W4A8Quantizer(group_size=...) groups each output channel's columns: it needs "
                "per_channel=True (the default)"
            )
        spec = (
            int4_weight(axis, observer)
            if group_size is None
            else grouped_int4_weight(group_size, observer)
        )
        weight = options.setdefault("weight", spec)
        if embedding_bits == 8:
            table = int8_weight(weight.axis, weight.observer)
            options["rules"] = (embedding_rule(table), *options.get("rules", ()))
        super().__init__(**options)
