"""Named quantization points of cell bodies, and the options that create them."""

from __future__ import annotations

from dataclasses import dataclass

POINT_KEY = "quantree_point"
"""``node.meta`` key holding the point name of a cell-body node."""


@dataclass(frozen=True)
class Point:
    """A named quantization point: a node of a cell body (``x``, ``gates``, ``cell``, ...).

    Point names are listed in ``quantree.cells_body``; combine with ``Rule.scope`` to reach
    one layer and direction (``"rnn.l1_reverse"``).
    """

    name: str


@dataclass(frozen=True)
class CellsOptions:
    """How to decompose a recurrent layer: ``split_gates`` gives each gate its own linears."""

    split_gates: bool = False
