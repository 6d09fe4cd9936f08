"""Cells mode, natively: a lowered cell body compiled into one program run for all steps."""
