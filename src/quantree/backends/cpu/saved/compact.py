"""What a saved program leaves out: aliases, example inputs and tracing provenance.

``torch.export.save`` writes a tensor once per storage but describes it once per name, and
an unrolled decoder's call sites read one weight through many names (``share_identical``):
the seq2seq model's 16 steps gave 235 buffer names for 90 tensors, each name a few hundred
bytes of JSON in the graph, the signature and the weights config. Its example inputs are
stored as a tensor file (an example image can weigh as much as a small model's int8 weights),
though loading reads only their structure (``module()`` names inputs in its shape guards by
them), and every node carries its tracing provenance (``from_node``, ``torch_fn``,
``stack_trace``) that nothing reads after loading. Module scopes (``nn_module_stack``) are
kept: reports and the numeric debugger place kernels by them.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map_only

from quantree.core.graphs import owner_of

DROPPED_METADATA = ("from_node", "torch_fn", "stack_trace", "source_fn_stack")
"""Node metadata a saved program does not keep (provenance of the export trace)."""


def _storage_key(t: torch.Tensor) -> tuple:
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
    )


def one_name_per_tensor(gm: fx.GraphModule) -> fx.GraphModule:
    """A module computing what ``gm`` does whose top graph reads each tensor by one name.

    ``gm`` is not changed: the new module has a copy of its graph and shares its tensors and
    submodules.
    """
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # the pytree calling convention
    graph.output(graph.graph_copy(gm.graph, {}))
    first: dict[tuple, str] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        owner, leaf = owner_of(gm, str(node.target))
        value = getattr(owner, leaf, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            node.target = first.setdefault(_storage_key(value), str(node.target))
    compact = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    compact.meta = dict(gm.meta)
    return compact


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def drop_provenance(program: torch.export.ExportedProgram) -> None:
    """Remove what only the export trace needed: nodes' provenance, and the example inputs'
    values (each becomes one zero broadcast to its shape: one element on disk)."""
    if program.example_inputs is not None:  # kept as structure: ``module()``'s guards read it
        program.example_inputs = tree_map_only(torch.Tensor, _stand_in, program.example_inputs)
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, fx.Graph) else ():
            for key in DROPPED_METADATA:
                node.meta.pop(key, None)
