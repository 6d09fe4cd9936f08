"""Capture with the model's parameters not requiring grad (restored afterwards).

``torch.export`` traces the model with fake tensors. A parameter that requires grad makes
every activation downstream require grad too, and torch's decomposition of ``aten.lstm``
(``aten.gru``), which export runs to learn the output shapes, then takes its generic path:
one traced cell per time step, per layer and direction, so capture time grows with the
sequence length. Without grad it takes the path whose cost does not depend on the length.
The exported graph is the same (quantization is for inference; nothing quantree does needs
gradients); the flags are put back even when export fails, so the model is left as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def parameters_without_grad(model: torch.nn.Module) -> Iterator[None]:
    """``requires_grad_(False)`` on each parameter that requires grad, for the block."""
    changed = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in changed:
            p.requires_grad_(False)
        yield
    finally:
        for p in changed:
            p.requires_grad_(True)
