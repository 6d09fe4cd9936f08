"""normalize: the float rewrites prepare makes before anything is annotated.

Batch norm folded into the conv/linear before it, parameter-only computations folded into
constants, matrix products with constant weights read as ``linear``, a spelled-out tanh GELU
read as ``gelu``, every tuple leaf an explicit ``getitem``. The result computes what the
captured model computes (folding batch norm reassociates floats: within about 1e-5 relative;
the GELU is the same formula, to float rounding), and it is what quantization sees, so tools
that compare a float model with its quantized one compare against this graph: a folded conv's
float counterpart is conv + batch norm, not the conv alone.
"""

from __future__ import annotations

import torch.fx as fx

from quantree.core.graphs import copy_graph_module
from quantree.core.normalizing.canonicalize import canonicalize
from quantree.core.normalizing.fold import fold_batch_norm, fold_constants, own_written_state
from quantree.core.normalizing.gelu_forms import gelu_forms
from quantree.core.normalizing.linear_forms import linear_forms


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """A normalized copy of captured ``gm``; ``gm`` itself is not changed."""
    # parameter-only computations fold first: a weight transposed on every call (Falcon's
    # ``x @ self.weight.T``) is then the constant matrix linear_forms looks for
    gm = linear_forms(fold_constants(own_written_state(copy_graph_module(gm))))
    return canonicalize(fold_batch_norm(gelu_forms(gm)))
