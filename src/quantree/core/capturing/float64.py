"""A float64 model is refused at capture, with the fix, before anything is quantized.

The reference graph's q/dq ops (pt2e's ``quantized_decomposed``) compute in float32 and
refuse float64, so no point of a float64 model can be quantized: the recipes leave float64
tensors float (a float32 model's float64 rotary table or positions stay as written), which
for a model whose weights are float64 would give back a float model with nothing quantized.
Said here, once, naming a parameter, instead.
"""

from __future__ import annotations

import torch

from quantree.core.errors import QuantreeError


def refuse_float64(model: torch.nn.Module) -> None:
    """A ``QuantreeError`` if a parameter of ``model`` is float64 (buffers may be: a model
    keeps a float64 table on purpose)."""
    for name, parameter in model.named_parameters():
        if parameter.dtype == torch.float64:
            raise QuantreeError(
                f"parameter {name} of {type(model).__name__} is torch.float64: quantree "
                "quantizes float32, bfloat16 or float16 models (the q/dq ops compute in "
                "float32). Capture model.float() with float32 example inputs and calibration"
            )
