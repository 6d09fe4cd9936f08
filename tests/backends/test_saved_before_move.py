"""A file saved before issue 23's move of ``backends/cpu`` loads after it, bit for bit.

``tests/fixtures/saved_before_move.pt2`` was written by quantree at c04c399 (the layout before
the move) with ``tests/fixtures/make_saved_before_move.py``: a conv + LSTM + linear model
lowered for ``CPU``. Its expected output was computed then, from the loaded file, and is
the same on every kernel path (portable, avx2, avx512vnni were checked when it was made).
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantree.backends import load

FIXTURES = Path(__file__).parent.parent / "fixtures"


def test_a_file_saved_before_the_move_loads_and_computes_the_same_bits() -> None:
    expected = torch.load(FIXTURES / "saved_before_move_io.pt", weights_only=True)
    module = load(FIXTURES / "saved_before_move.pt2")
    out = module(expected["input"])
    assert out.dtype == expected["output"].dtype
    assert torch.equal(out, expected["output"])
