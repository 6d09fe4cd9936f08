"""The native int8 CPU backend: lowering rules, packed weights, and C++ kernels."""

from quantree.backends.cpu.backend import CPU, cpu_backend
from quantree.backends.cpu.saved.serialize import load, save
from quantree.backends.cpu.speed_check import speed_of

__all__ = ["CPU", "cpu_backend", "load", "save", "speed_of"]
