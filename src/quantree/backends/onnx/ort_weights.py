"""How the ONNX Runtime target lays out quantree's int8 weights for ORT's integer operators.

``DynamicQuantizeLSTM`` and ``DynamicQuantizeMatMul`` take a weight's scale and zero point per
tensor or per output column. MLAS (the GEMM under both) pays for a per-column scale: it
scales each column of the product on its own (``benchmarks/README.md`` compares the
layouts). Hence:

- zero points: zeros (quantree's recurrent weights are symmetric), of their scale's shape
  (``DynamicQuantizeLSTM`` reads a zero point as per column when its scale is).
- the recurrent weights ``R`` run once per time step, on a single row at batch 1, where the
  per-column epilogue is a large part of the product. When the rows' scales are close
  (``per_tensor``), ``R`` is rounded again onto one scale (per direction where the
  operator allows), the largest row's, which needs no clipping. That is a second rounding
  of quantree's int8 values: it adds rounding noise of about the per-row grid's size, and
  the hidden state, quantized per step by the operator itself, carries more. Rows whose
  scales are far apart (a trained layer with dead gate rows) would lose most of their bits
  on the largest row's grid: they keep per-row scales (in the GRU/RNN ``Scan`` step applied
  by a ``Mul`` after a product on a scale of 1, see ``ort_recurrence``).
- the input weights ``W``: their product runs once per call over every time step, where
  the epilogue is a small part of the work: ``DynamicQuantizeMatMul`` (GRU, RNN) gets
  quantree's exact values and per-row scales. ``DynamicQuantizeLSTM`` pairs per-column
  scales with per-column zero points, its slower path: ``W`` goes onto one scale there
  too, under the same rule, the layout ONNX Runtime's own quantizer gives the operator.
"""

from __future__ import annotations

import numpy as np

from quantree.backends.onnx.ort_constants import QuantizedConstant

SPREAD_LIMIT = 1.5
"""Largest ``max(scale)^2 / mean(scale^2)`` over a direction's rows for which ``R`` is
rounded onto one scale: the added rounding noise (a uniform error on the largest row's grid)
is then at most 1.5 times the per-row grid's average. Freshly initialized layers (rows
drawn alike) meet it; trained ones mostly do not, and keep exact per-row scales: rounding
them onto the largest row's grid costs more accuracy than the speed is worth."""


def per_tensor(q: QuantizedConstant, shared: bool = False) -> QuantizedConstant | None:
    """``q`` (``[dirs, rows, cols]`` int8, zero points 0) rounded onto one scale per
    direction, the largest row's (``scale`` and ``zero_point`` then ``[dirs]``), or with
    ``shared`` onto one scale for all directions, repeated per direction (the layout
    ``DynamicQuantizeLSTM`` is given by ONNX Runtime's own quantizer); None when the row
    scales spread past ``SPREAD_LIMIT`` (``q`` is then used as it is)."""
    scale = q.scale.astype(np.float64)  # [dirs, rows]
    if scale.size == 0 or not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        return None
    groups = scale.reshape(1, -1) if shared else scale  # the rows that share one scale
    top = groups.max(axis=1)
    if np.any(top**2 > SPREAD_LIMIT * (groups**2).mean(axis=1)):
        return None
    per_direction = np.broadcast_to(top, scale.shape[:1])
    ratio = scale / per_direction[:, None]  # <= 1: the rounded values stay in [-127, 127]
    values = np.rint(q.values.astype(np.float64) * ratio[:, :, None])
    values = np.clip(values, -127, 127).astype(np.int8)
    dirs = len(per_direction)
    return QuantizedConstant(values, per_direction.astype(np.float32), np.zeros(dirs, np.int8))
