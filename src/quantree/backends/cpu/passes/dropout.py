"""Dropout in evaluation mode removed after lowering.

A model captured in eval mode keeps each ``nn.Dropout`` as ``aten.dropout(x, p, False)``
(BERT has seven in two layers: embeddings, attention probabilities, two per block), which
returns its input. It computes nothing, but each is a dispatcher call on every forward, and
it reads the value before it: a region program (``passes/regions.py``) ends wherever an op it
does not run reads one of its values, so every dropout after a softmax or a projection cuts
the region there. ``train=True`` computes a random mask and stays (never in a lowered eval
graph, but a hand-built one may hold it).
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
EVAL_DROPOUTS = (aten.dropout.default, aten.feature_dropout.default)


def _eval_mode(n: fx.Node) -> bool:
    train = n.kwargs.get("train", n.args[2] if len(n.args) > 2 else None)
    return train is False


def drop_eval_dropout(gm: fx.GraphModule) -> int:
    """Replace every ``dropout(x, p, train=False)`` by ``x``; returns how many went."""
    dropped = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in EVAL_DROPOUTS and _eval_mode(n):
            source = n.args[0]
            if not isinstance(source, fx.Node):
                continue
            n.replace_all_uses_with(source)
            gm.graph.erase_node(n)
            dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped
