"""quantree: graph-mode post-training static quantization for nested structures.

gm = capture(model, example_args)
prepared = prepare(gm, Int8Quantizer())
calibrate(prepared, data)
ref = convert(prepared)
"""

# Registers torch.ops.quantree.*, so that a plain torch.export.load of a CPU-lowered program
# works once quantree is imported (the kernels themselves load at first use).
import quantree.backends.cpu.ops  # noqa: F401
from quantree.backends.executorch import export_executorch
from quantree.backends.onnx import OnnxTarget, export_onnx
from quantree.core.calibrate import calibrate
from quantree.core.convert import Unobserved, convert
from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.lower import (
    REFERENCE,
    Backend,
    Dequantized,
    LoweringContext,
    LoweringRule,
    Quantized,
)
from quantree.core.observing.distributed import RankFailed, merge_statistics, shard
from quantree.core.observing.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    Observer,
)
from quantree.core.points import Point
from quantree.core.quantizer import Annotation, Quantizer, Rule
from quantree.core.refining.refine import Refine, RefinedLayer, refine
from quantree.core.specs import (
    DerivedSpec,
    FixedSpec,
    ObserverKind,
    QDtype,
    QParams,
    QuantSpec,
    SharedSpec,
    bias_spec,
)
from quantree.core.stages import NodeQuant
from quantree.core.training.qat import freeze_qat
from quantree.core.values import Use, Value
from quantree.pipeline import lower, prepare, prepare_qat, quantize
from quantree.recipes.activation_points import ActivationPoints
from quantree.recipes.int8 import A16W8Quantizer, Int8Quantizer, RecurrentMode
from quantree.recipes.interop import recurrent_rules
from quantree.recipes.pt2e import from_pt2e
from quantree.recipes.w4a8 import W4A8Quantizer, int4_weight
from quantree.recurrent.capture import capture
from quantree.recurrent.decompose import CellsOptions
from quantree.tools.compare import Comparison, compare
from quantree.tools.metrics import sqnr
from quantree.tools.mixed_precision import MixedPrecision, TargetUnreachable, mixed_precision

__all__ = [
    "ActivationPoints",
    "REFERENCE",
    "A16W8Quantizer",
    "CellsOptions",
    "Comparison",
    "Point",
    "RecurrentMode",
    "Annotation",
    "Backend",
    "DerivedSpec",
    "Dequantized",
    "FixedSpec",
    "HistogramObserver",
    "Int8Quantizer",
    "W4A8Quantizer",
    "int4_weight",
    "LoweringContext",
    "LoweringRule",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "NodeQuant",
    "Observer",
    "ObserverKind",
    "QDtype",
    "QParams",
    "QuantSpec",
    "Quantized",
    "QuantreeError",
    "QuantreeWarning",
    "RankFailed",
    "Refine",
    "RefinedLayer",
    "Quantizer",
    "Rule",
    "SharedSpec",
    "Unobserved",
    "Use",
    "Value",
    "bias_spec",
    "calibrate",
    "capture",
    "compare",
    "convert",
    "export_executorch",
    "export_onnx",
    "OnnxTarget",
    "from_pt2e",
    "recurrent_rules",
    "refine",
    "lower",
    "merge_statistics",
    "mixed_precision",
    "MixedPrecision",
    "TargetUnreachable",
    "prepare",
    "prepare_qat",
    "freeze_qat",
    "quantize",
    "shard",
    "sqnr",
]
