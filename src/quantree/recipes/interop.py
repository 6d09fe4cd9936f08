"""Pieces for composing quantree with other toolchains' quantizers.

``qt.from_pt2e(X86InductorQuantizer().set_global(...)) + qt.recurrent_rules()`` quantizes what
the pt2e quantizer annotates as it says, and the LSTM/GRU/RNN it leaves float (pt2e observes
single-tensor outputs only) with quantree's recurrent rules.
"""

from __future__ import annotations

import torch

from quantree.core.quantizer import Annotation, Quantizer, Rule
from quantree.core.specs import QuantSpec, int8_activation, int8_weight
from quantree.recipes.int8 import RecurrentMode
from quantree.recipes.recurrent import cells_rules
from quantree.recurrent.call import CELL_OPS, RECURRENT_OPS
from quantree.recurrent.decompose import CellsOptions
from quantree.recurrent.whole import recurrent_cell_annotation, recurrent_whole_annotation


def recurrent_rules(
    *,
    activation: QuantSpec | None = None,
    weight: QuantSpec | None = None,
    recurrent: RecurrentMode = RecurrentMode.WHOLE,
    scope: str | None = None,
) -> Quantizer:
    """Only the recurrent layers (and cells) of quantree's recipe, to add to another quantizer.

    ``activation`` defaults to int8 affine and ``weight`` to int8 symmetric per channel. In
    cells mode the cell bodies get the recipe's cell rules.
    """
    act = activation or int8_activation()
    wgt = weight or int8_weight(0)
    if recurrent is RecurrentMode.CELLS:
        return Quantizer(cells_rules(act, wgt, act, act.dtype, CellsOptions(), {}, scope))

    def whole(node: torch.fx.Node) -> Annotation:
        return recurrent_whole_annotation(node, act, wgt)

    def cell(node: torch.fx.Node) -> Annotation:
        return recurrent_cell_annotation(node, act, wgt)

    return Quantizer((Rule(RECURRENT_OPS, whole, scope), Rule(CELL_OPS, cell, scope)))
