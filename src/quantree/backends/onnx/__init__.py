"""QDQ ONNX export of the reference graph, checked in ONNX Runtime.

``qt.export_onnx(ref, example_args, "model.onnx")`` writes ``qt.convert``'s graph with
``QuantizeLinear``/``DequantizeLinear`` around standard ONNX ops (``onnx``/``onnxscript``, the
``[onnx]`` extra); ``run_onnx(path, args)`` runs it in ONNX Runtime. ``target=
OnnxTarget.ONNXRUNTIME`` runs recurrent layers on ONNX Runtime's integer operators.
"""

from quantree.backends.onnx.export import export_onnx, onnx_session, run_onnx
from quantree.backends.onnx.target import OnnxTarget

__all__ = ["OnnxTarget", "export_onnx", "onnx_session", "run_onnx"]
