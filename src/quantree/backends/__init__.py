"""quantree's built-in backends beyond ``REFERENCE``: native int8 CPU kernels.

``lowered = qt.lower(ref, CPU)``; ``save(lowered, "model.pt2", example_args)`` writes a
``torch.export`` archive and ``load("model.pt2")`` gives back a module that runs it.
``cpu_isa()`` names the kernel path this machine runs (AVX-512 VNNI, AVX-VNNI, AVX2, portable).
"""

from quantree.backends.cpu.backend import CPU, cpu_backend
from quantree.backends.cpu.native.loader import cpu_isa
from quantree.backends.cpu.saved.serialize import load, save

__all__ = ["CPU", "cpu_backend", "cpu_isa", "load", "save"]
