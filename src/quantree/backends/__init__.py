"""quantree's built-in backends beyond ``REFERENCE``: native int8 CPU kernels.

    lowered = qt.lower(ref, CPU)
    save(lowered, "model.pt2", example_args)
    model = load("model.pt2")
"""

from quantree.backends.cpu import CPU
from quantree.backends.serialize import load, save

__all__ = ["CPU", "load", "save"]
