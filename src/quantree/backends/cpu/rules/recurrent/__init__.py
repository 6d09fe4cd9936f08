"""Lowering rules of recurrent layers: whole stacks (``layers``), cells mode's cells
(``cells``), packed sequences (``packed_sequence``)."""
