"""ExecuTorch export: quantree's reference graph lowered to XNNPACK and written as a ``.pte``.

``qt.export_executorch(ref, example_args, "model.pte")`` rewrites ``ref`` (``qt.convert`` or
``qt.quantize(..., backend="reference")`` output) into the q/dq dialect XNNPACK fuses
(:mod:`.dialect`), exports it with ``torch.export`` at the example's shapes, lowers it with
``to_edge_transform_and_lower(partitioner=[XnnpackPartitioner()])`` and writes
``to_executorch()``'s program. What XNNPACK does not take stays in ExecuTorch's portable
ops; a q/dq pair it does not fuse (an int16 activation) runs as the quantized kernels
library's ``quantized_decomposed`` op, so a runtime running the file links that library
(``executorch.kernels.quantized`` in Python). A whole-mode recurrent layer is one
``quantree_et::rnn`` op, run by quantree's own kernel library (:mod:`.kernels`; Python:
``run_executorch`` registers it, C++: docs/deployment-executorch.md). :func:`delegation` says
what went where.
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.destination import writable_destination
from quantree.backends.executorch import kernels
from quantree.backends.executorch.dialect import fp32_layers, to_xnnpack_dialect
from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.graphs import nested_graphs
from quantree.core.qdq import is_dequantize, is_quantize
from quantree.core.stages import CONVERTED, STAGE_KEY, stage_of

INSTALL = (
    "pip install --no-deps executorch==1.5.1 && pip install flatbuffers ruamel.yaml tabulate "
    "pyyaml packaging expecttest"
)
DELEGATE_CALL = "executorch_call_delegate"
KERNEL_OP = b"quantree_et::"
"""How a ``.pte`` names an operator of quantree's ExecuTorch kernel library."""
aten = torch.ops.aten
FLOAT_RECURRENT = (
    *(aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input),
    *(aten.lstm.data, aten.gru.data, aten.rnn_tanh.data, aten.rnn_relu.data),
)


def require_executorch() -> None:
    """Import ExecuTorch and its quantized kernels library, or say how to install them."""
    try:
        import executorch.exir
        import executorch.kernels.quantized  # noqa: F401  (out-variants of portable q/dq)
    except ImportError as error:
        raise QuantreeError(
            f"ExecuTorch export needs the executorch package ({error}); install it without "
            f"pulling another torch: {INSTALL}"
        ) from None


def check_reference(model: object) -> fx.GraphModule:
    """``model`` must be a reference graph: what XNNPACK lowers is its q/dq patterns.

    ``qt.convert``'s output is marked converted; one saved with ``torch.export.save`` and
    loaded again has lost the mark but still reads q/dq ops."""
    from quantree.backends.fastest import reference_of

    if isinstance(model, fx.GraphModule) and reference_of(model) is not None:
        model = reference_of(model)  # qt.quantize's default output keeps its reference graph
    for node in model.graph.nodes if isinstance(model, fx.GraphModule) else ():
        namespace = getattr(node.target, "namespace", "")
        if node.op == "call_function" and namespace == "quantree":
            raise QuantreeError(
                f"export_executorch: node {node.name} calls quantree's native kernel "
                f"{node.target}: the model was lowered to the CPU backend, which ExecuTorch "
                "cannot run; export the reference graph instead: qt.convert(prepared), "
                "qt.quantize(model, args, data, backend='reference'), or from the command "
                "line quantree quantize ... --backend reference"
            )
    loaded = isinstance(model, fx.GraphModule) and any(
        is_quantize(n) or is_dequantize(n) for n in model.graph.nodes
    )
    if not isinstance(model, fx.GraphModule) or not (
        model.meta.get(STAGE_KEY) == CONVERTED or loaded
    ):
        got = stage_of(model) if isinstance(model, fx.GraphModule) else type(model).__name__
        raise QuantreeError(
            f"export_executorch expects quantree's reference graph (qt.convert output), got "
            f"{got}: pass qt.convert(prepared), qt.quantize(model, args, data)'s output, or "
            "a program saved with backend='reference' (quantree quantize --backend reference)"
        )
    if nested_graphs(model):
        name = next(iter(nested_graphs(model)))
        raise QuantreeError(
            f"export_executorch: {name} is a nested graph (a cells-mode recurrent loop), which "
            "this exporter does not lower yet; quantize with "
            "qt.Int8Quantizer(recurrent=qt.RecurrentMode.WHOLE)"
        )
    return model


@dataclass(frozen=True)
class Delegation:
    """What runs where in a lowered program: XNNPACK calls and the ops left to the runtime."""

    delegate_calls: int
    portable_ops: dict[str, int]
    fp32_layers: tuple[str, ...]

    def render(self) -> str:
        left = ", ".join(f"{op} x{n}" for op, n in sorted(self.portable_ops.items())) or "none"
        fp32 = f"; fp32 in XNNPACK: {len(self.fp32_layers)} layer(s)" if self.fp32_layers else ""
        return f"XNNPACK calls: {self.delegate_calls}; portable ops: {left}{fp32}"


def delegation(edge_graph: fx.Graph, layers: Sequence[str] = ()) -> Delegation:
    """Count the delegate calls and the ops left outside them in a lowered edge graph."""
    left: collections.Counter[str] = collections.Counter()
    calls = 0
    for node in edge_graph.nodes:
        if node.op != "call_function" or node.target.__name__ == "getitem":
            continue
        name = str(getattr(node.target, "__name__", node.target))
        if name == DELEGATE_CALL:
            calls += 1
        else:
            left[name.removeprefix("aten.").removesuffix(".default")] += 1
    return Delegation(calls, dict(left), tuple(layers))


@dataclass(frozen=True)
class Lowered:
    """An ExecuTorch program lowered from a reference graph: its bytes and where ops went."""

    buffer: bytes
    delegation: Delegation


def lower_executorch(
    model: fx.GraphModule,
    example_args: tuple[Any, ...],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
) -> Lowered:
    """The ``.pte`` bytes of the reference graph ``model`` lowered with XNNPACK (see above)."""
    require_executorch()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    gm = to_xnnpack_dialect(check_reference(model))
    layers = fp32_layers(gm)
    if layers:
        warnings.warn(
            f"export_executorch: {len(layers)} conv/linear layer(s) run in fp32 in XNNPACK "
            f"(their quantized inputs rounded as the reference does, by portable q/dq ops): "
            f"{', '.join(layers[:5])}{' ...' if len(layers) > 5 else ''}. XNNPACK runs int8 "
            "only a layer whose int8 input and int8 output are both quantized; for that, "
            "quantize with qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)",
            QuantreeWarning,
            stacklevel=3,
        )
    recurrent = [n.name for n in gm.graph.nodes if n.target in FLOAT_RECURRENT]
    if recurrent:
        warnings.warn(
            f"export_executorch: recurrent layer(s) {', '.join(recurrent[:5])} run in fp32 "
            "(ExecuTorch unrolls them): only a whole-mode layer on a padded batch whose input, "
            "weights and outputs are int8 becomes quantree's int8 kernel (quantree_et::rnn); "
            "their quantized inputs and outputs are rounded as the reference does",
            QuantreeWarning,
            stacklevel=3,
        )
    with torch.no_grad():
        exported = torch.export.export(gm, tuple(example_args), dict(example_kwargs or {}))
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    where = delegation(edge.exported_program().graph, layers)
    return Lowered(bytes(edge.to_executorch().buffer), where)


def export_executorch(
    model: fx.GraphModule,
    example_args: tuple[Any, ...],
    path: str | os.PathLike[str],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Write the reference graph ``model`` to ``path`` as an ExecuTorch ``.pte`` for XNNPACK.

    ``example_args`` fix the program's input shapes (the ``.pte`` is static). The file is
    written whole or not at all. Returns ``path``."""
    target = writable_destination(path, "export ExecuTorch")
    lowered = lower_executorch(model, example_args, example_kwargs=example_kwargs)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_bytes(lowered.buffer)
    os.replace(partial, target)
    return target


def run_executorch(program: bytes | str | os.PathLike[str], args: Sequence[Any]) -> list[Any]:
    """Run a ``.pte`` (its bytes or its path) with ExecuTorch's runtime; the flat outputs."""
    require_executorch()
    from executorch.runtime import Runtime

    data = program if isinstance(program, bytes) else Path(program).read_bytes()
    if KERNEL_OP in data:  # the program calls quantree's kernel library: register it first
        kernels.load()
    method = Runtime.get().load_program(data).load_method("forward")
    flat = [a for a in torch.utils._pytree.tree_leaves(tuple(args)) if a is not None]
    return list(method.execute(flat))
