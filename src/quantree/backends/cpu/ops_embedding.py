"""Embedding lookups in an int8 table: gather the rows, then dequantize only those.

The reference graph dequantizes the whole table and then gathers (``dequantize ->
embedding``), which on a 30522 x 128 vocabulary is most of a small BERT's time; gathering
first does the same arithmetic on the rows that are read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.registry import op


@op(
    "embedding_rows(Tensor table, Tensor scale, Tensor zero_point, Tensor indices, "
    "bool per_row) -> Tensor"
)
def embedding_rows(
    table: Tensor, scale: Tensor, zero_point: Tensor, indices: Tensor, per_row: bool
) -> Tensor:
    """Rows ``indices`` of the int8 ``table``, dequantized with the same arithmetic as
    ``quantized_decomposed.dequantize_per_channel`` (axis 0) or ``_per_tensor``."""
    rows = torch.nn.functional.embedding(indices, table)
    if per_row:
        zp = zero_point[indices].unsqueeze(-1)
        return ((rows - zp) * scale[indices].unsqueeze(-1)).to(torch.float32)
    return (rows.to(torch.float32) - int(zero_point)) * float(scale)


@torch.library.register_fake("quantree::embedding_rows")
def _(table, scale, zero_point, indices, per_row):
    return table.new_empty((*indices.shape, table.shape[1]), dtype=torch.float32)
