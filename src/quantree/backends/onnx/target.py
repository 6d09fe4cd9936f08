"""Which runtime the ONNX export is for, and what runs float there.

- ``OnnxTarget.QDQ`` (the default): standard ops between ``QuantizeLinear``/
  ``DequantizeLinear``, which TensorRT, OpenVINO, QNN and ONNX Runtime all read and fuse into
  integer kernels where they have one. None has a QDQ pattern for ``LSTM``/``GRU``/``RNN``:
  those run float between dequantized weights, and the export says so in one warning.
- ``OnnxTarget.ONNXRUNTIME``: the same graph with its recurrent operators rewritten into
  ONNX Runtime's integer operators (``ort_target``); it needs the ``com.microsoft`` domain,
  so other runtimes do not load it.
"""

from __future__ import annotations

import enum
import os
import warnings

from quantree.core.errors import QuantreeWarning


class OnnxTarget(enum.Enum):
    QDQ = "qdq"
    ONNXRUNTIME = "onnxruntime"


FLOAT_IN_QDQ = ("LSTM", "GRU", "RNN")


def float_in_qdq(op_types: list[tuple[str, str]]) -> None:
    """Warn once naming the ``(op_type, name)`` nodes a QDQ runtime computes in float."""
    named = [f"{op} {name}" for op, name in op_types if op in FLOAT_IN_QDQ]
    if named:
        warnings.warn(
            f"{len(named)} op(s) of this QDQ export run in float in ONNX Runtime, OpenVINO and "
            f"TensorRT (no runtime fuses a dequantized recurrent layer): {', '.join(named)}; "
            "for int8 recurrent layers in ONNX Runtime export with "
            "target=qt.OnnxTarget.ONNXRUNTIME",
            QuantreeWarning,
            stacklevel=3,
        )


def finish_for_onnxruntime(path: str | os.PathLike[str]) -> None:
    """Rewrite the QDQ model at ``path`` for ONNX Runtime in place; warn about what stays float."""
    import onnx

    from quantree.backends.onnx.ort_target import to_onnxruntime

    model = onnx.load(str(path))
    left = to_onnxruntime(model)
    onnx.save(model, str(path))
    if left:
        warnings.warn(
            f"{len(left)} recurrent op(s) stay float in the ONNX Runtime export: {', '.join(left)}",
            QuantreeWarning,
            stacklevel=3,
        )
