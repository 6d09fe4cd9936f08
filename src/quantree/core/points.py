"""Named quantization points: nodes a recipe addresses by role rather than by op."""

from __future__ import annotations

from dataclasses import dataclass

POINT_KEY = "quantree_point"
"""``node.meta`` key holding the point name of a node (set by whoever built the graph)."""


@dataclass(frozen=True)
class Point:
    """A named quantization point: a node a graph builder tagged with ``POINT_KEY``.

    Cells mode tags the nodes of its cell bodies (``x``, ``gates``, ``cell``, ...; listed in
    ``quantree.recurrent.cell_graph``); combine with ``Rule.scope`` to reach one layer and
    direction (``"rnn.l1_reverse"``).
    """

    name: str
