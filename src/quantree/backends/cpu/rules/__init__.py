"""Lowering rules of the CPU backend, one module per op family (tried in ``backend.py``'s order)."""
