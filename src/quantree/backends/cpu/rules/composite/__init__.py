"""Lowering rules that run a pattern of several reference ops as one native kernel: a
hand-written global layer norm as ``group_norm``, ``dq -> glu -> q`` as ``quantree.glu``."""
