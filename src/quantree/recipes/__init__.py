"""Recipes: quantizers built from rules (what to quantize, and how), on top of the core.

``Int8Quantizer`` and ``A16W8Quantizer`` (``int8.py``), the AUTO activation points
(``activation_points.py``), the recurrent rules (``recurrent.py``), and pt2e quantizer
translation (``pt2e.py``, ``interop.py``).
"""

from quantree.recipes.int8 import A16W8Quantizer, Int8Quantizer, RecurrentMode

__all__ = ["A16W8Quantizer", "Int8Quantizer", "RecurrentMode"]
