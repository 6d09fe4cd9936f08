"""Lowering rules for ops that move int8 values without changing their grid (by op)."""
