"""A model handed over in train mode: captured in eval mode, and said so once.

Quantization is for inference: batch norm must read its running statistics (the only ones
a quantized model can fold), dropout must be off. Capturing a forgotten ``model.train()`` as
it is would quantize a different model (batch statistics) or fail at prepare, so capture
switches to eval mode for the export and back afterwards. Doing that silently hid the
choice: one ``QuantreeWarning`` names the modules that act differently in train mode and
how to say eval mode is meant.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from quantree.core.errors import QuantreeWarning

_TRAIN_DEPENDENT = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
"""Module types whose forward reads ``self.training``."""


def _acts_differently(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.track_running_stats  # otherwise the same statistics in both modes
    return isinstance(module, _TRAIN_DEPENDENT)


def warn_train_mode(model: torch.nn.Module, stacklevel: int) -> None:
    """One ``QuantreeWarning`` if ``model`` has modules in train mode that act differently.

    A model in train mode whose modules all compute the same in both modes gets none: the
    mode changes nothing it computes.
    """
    if not model.training:
        return
    named = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if _acts_differently(module) and module.training
    ]
    if not named:
        return
    shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    warnings.warn(
        f"the model is in train mode, in which {shown} would act differently. quantree "
        "captures it in eval mode, as the quantized model runs (batch norm reads its running "
        "statistics, dropout is off), and leaves the model in train mode. Call model.eval() "
        "before quantizing to say so and silence this warning",
        QuantreeWarning,
        stacklevel=stacklevel,
    )
