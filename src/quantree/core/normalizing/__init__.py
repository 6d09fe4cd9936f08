"""Graph rewrites prepare runs before annotation: canonical op forms, constant and batch-norm
folding."""
