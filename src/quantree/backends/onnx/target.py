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


def finish_export(path: str | os.PathLike[str], target: OnnxTarget) -> None:
    """Rewrite the exported model at ``path`` in place for ``target``: quantize/dequantize
    pairs on constants folded (``constant_qdq``), int8 activations on uint8 from opset 21
    (``uint8_activations``); recurrent layers on ONNX Runtime's integer
    operators for ``ONNXRUNTIME``, with float weights for ``QDQ``; one warning naming what
    runs float."""
    import onnx

    from quantree.backends.onnx.constant_qdq import float_recurrent_weights, fold_constant_qdq
    from quantree.backends.onnx.ort_target import to_onnxruntime
    from quantree.backends.onnx.uint8_activations import uint8_activations

    model = onnx.load(str(path))
    fold_constant_qdq(model)
    uint8_activations(model)  # before ONNX Runtime's own int8 -> uint8 move trips it at opset 21
    if target is OnnxTarget.ONNXRUNTIME:
        left = to_onnxruntime(model)
        where = "the ONNX Runtime export"
        float_recurrent_weights(model)  # those left float: weights dequantized once, here
    else:
        float_recurrent_weights(model)
        left = [f"{n.op_type} {n.name}" for n in model.graph.node if n.op_type in FLOAT_IN_QDQ]
        where = (
            "this QDQ export in ONNX Runtime, OpenVINO and TensorRT (none fuses a dequantized "
            "recurrent layer)"
        )
    onnx.save(model, str(path))
    if left:
        hint = (
            ""
            if target is OnnxTarget.ONNXRUNTIME
            else "; for int8 recurrent layers in ONNX Runtime export with "
            "target=qt.OnnxTarget.ONNXRUNTIME"
        )
        warnings.warn(
            f"{len(left)} op(s) run in float in {where}: {', '.join(left)}{hint}",
            QuantreeWarning,
            stacklevel=3,
        )
