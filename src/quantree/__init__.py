"""quantree: graph-mode post-training static quantization for nested structures.

gm = capture(model, example_args)
prepared = prepare(gm, Int8Quantizer())
calibrate(prepared, data)
ref = convert(prepared)
"""

from quantree.backend import (
    REFERENCE,
    Backend,
    Dequantized,
    LoweringContext,
    LoweringRule,
    Quantized,
    lower,
)
from quantree.calibrate import calibrate
from quantree.capture import capture
from quantree.compare import Comparison, compare
from quantree.convert import convert
from quantree.errors import QuantreeError, QuantreeWarning
from quantree.int8 import A16W8Quantizer, Int8Quantizer, RecurrentMode
from quantree.metrics import sqnr
from quantree.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    Observer,
)
from quantree.pipeline import quantize
from quantree.points import CellsOptions, Point
from quantree.prepare import NodeQuant, prepare
from quantree.quantizer import Annotation, Quantizer, Rule
from quantree.specs import (
    DerivedSpec,
    FixedSpec,
    ObserverKind,
    QDtype,
    QParams,
    QuantSpec,
    SharedSpec,
    bias_spec,
)
from quantree.values import Use, Value

__all__ = [
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
    "Quantizer",
    "Rule",
    "SharedSpec",
    "Use",
    "Value",
    "bias_spec",
    "calibrate",
    "capture",
    "compare",
    "convert",
    "lower",
    "prepare",
    "quantize",
    "sqnr",
]
