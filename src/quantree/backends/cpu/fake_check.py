"""A loaded graph run once on fake tensors shaped like its saved example, before any call.

Every node of a file's graph may be well named and still not fit its arguments: a
positional argument moved to a keyword, an index past a dimension, a shape that no longer
matches the tensor it views. The first real call would raise whatever the op raises (a raw
``RuntimeError``, an ``IndexError``) far from the file that caused it. Propagating fake
tensors (shapes and dtypes only, nothing allocated, no kernel run) through the graph at
load finds those nodes while the file is being read, naming the node; it costs a few
milliseconds per hundred nodes. The native ops' own contracts (``native_checks``,
``program_checks``) still run at each call: their fake kernels check shapes only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map_only

from quantree.core.errors import QuantreeError


class _Run(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except QuantreeError:
            raise
        except Exception as error:
            text = str(error).strip().splitlines()
            raise QuantreeError(
                f"node {n.name} ({n.target}) does not run on the saved example's shapes: "
                f"{type(error).__name__}: {text[0][:200] if text else ''}"
            ) from None


def check_on_example(module: fx.GraphModule, example: Any) -> None:
    """Run ``module`` on fake tensors like ``example`` (``(args, kwargs)`` as
    ``ExportedProgram.example_inputs`` holds it); a ``QuantreeError`` naming the first node
    that does not run."""
    if example is None:
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = tree_leaves(tree_map_only(torch.Tensor, mode.from_tensor, example))
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders):
        raise QuantreeError(
            f"the saved example has {len(flat)} inputs, the graph {len(placeholders)}"
        )
    with mode:
        _Run(module).run(*flat)
