"""Refining a reference graph's weights after calibration: rounding chosen against the float
layer's output, and bias correction."""
