"""Observers, their statistics merged across ranks, and the quantization parameters computed
from them."""
