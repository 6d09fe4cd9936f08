"""flat_inputs: a graph whose inputs are already flat does not flatten them on every call.

torch.export's graph modules start ``forward`` with ``fx_pytree.tree_flatten_spec(([x],
{}), self._in_spec)`` and end with ``pytree.tree_unflatten((y,), self._out_spec)``. When
every input is a leaf (no nested arguments, no keywords) the first is the identity and
still costs on every call; when the output is one leaf the second is too. On a small
lowered model that is a visible share
of the call, so such graphs get a code generator that binds the arguments directly. Any
other structure keeps torch's code generator: the generated ``forward`` computes the same
values either way, and ``model.code`` shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch.fx.graph import _PyTreeCodeGen
from torch.utils._pytree import TreeSpec


class FlatInputsCodeGen(_PyTreeCodeGen):
    """torch's pytree code generator without the identity flatten / unflatten."""

    def gen_var_bindings(self, fn_args: list[str], free_vars: list[str], expanded_def: bool) -> str:
        names = [v.split(":")[0].split("#")[0].strip() for v in free_vars]
        count = self.pytree_info.in_spec.child(0).num_children
        given = list(self.pytree_info.orig_args[:count])
        if names == given:
            return self._format_annotations(free_vars, expanded_def)
        bindings = self._format_annotations(free_vars, expanded_def)
        return bindings + f"\n    {', '.join(names)}, = ({', '.join(given)},)"

    def generate_output(
        self,
        output_args: Any,
        *,
        descs: Sequence[str] | None = None,
        repr_fn: Callable[[object], str] | None = None,
    ) -> str:
        spec = self.pytree_info.out_spec
        one = isinstance(output_args, list | tuple) and len(output_args) == 1
        if spec is not None and spec.is_leaf() and one:
            return f"return {(repr_fn or repr)(output_args[0])}"
        return super().generate_output(output_args, descs=descs, repr_fn=repr_fn)


def _flat(spec: TreeSpec | None) -> bool:
    """``((leaf, ...), {})``: positional leaves, no keywords."""
    return (
        spec is not None
        and spec.type is tuple
        and spec.num_children == 2
        and spec.child(0).type is tuple
        and all(c.is_leaf() for c in spec.child(0).children())
        and spec.child(1).type is dict
        and spec.child(1).num_children == 0
    )


def bind_flat_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Give ``gm`` (in place) the direct-binding code generator where its inputs are flat
    leaves; returns ``gm``."""
    codegen = gm.graph._codegen
    if type(codegen) is not _PyTreeCodeGen:
        return gm
    info = codegen.pytree_info
    count = info.in_spec.child(0).num_children if _flat(info.in_spec) else -1
    if count != len(info.orig_args) or "self" in info.orig_args:
        return gm
    gm.graph._codegen = FlatInputsCodeGen(info)
    gm.recompile()
    return gm
