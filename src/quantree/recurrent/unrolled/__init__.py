"""Recurrences ``torch.export`` unrolled (a Python loop over time), folded back into loops."""
