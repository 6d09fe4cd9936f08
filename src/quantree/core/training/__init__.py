"""Quantization-aware training: fake quantization that learns, on the prepared graph."""
