"""QDQ ONNX: the reference graph written as ONNX with QuantizeLinear/DequantizeLinear.

What does the work:

- ``torch.onnx.export(dynamo=True)`` with onnxscript's torch_lib translates the reference
  graph's ``quantized_decomposed`` ops to ``QuantizeLinear``/``DequantizeLinear`` (per tensor
  and per channel, int8/uint8/int16, int32 biases) and the float ATen ops between them to
  standard ONNX ops; cells-mode loops are unrolled by ``torch.export`` into cell ops.
- Ours: whole-mode ``aten.lstm``/``gru``/``rnn_*`` become one ONNX ``LSTM``/``GRU``/``RNN`` per
  layer whose weights come straight from ``DequantizeLinear`` in ONNX gate order
  (``recurrent``); a per-tensor quantize to a range narrower than its type gets a ``Clip``;
  the opset is raised to 21 when int16 activations need it; ops with no ONNX form are named.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from quantree.backends.destination import writable_destination
from quantree.backends.fastest import reference_of
from quantree.backends.float_bias import bias_apart
from quantree.backends.onnx.int4_weights import has_int4_weights, int4_initializers, int4_opset
from quantree.backends.onnx.ort_kernels import ort_int8_saturates, saturating_ops
from quantree.backends.onnx.target import OnnxTarget, finish_export
from quantree.core.capture import unaliased
from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.graphs import copy_graph_module, nested_graphs
from quantree.core.qdq import DEQUANTIZE_OPS, QUANTIZE_OPS, QUANTIZE_PER_TENSOR
from quantree.core.stages import CONVERTED, STAGE_KEY, stage_of

INT16_OPSET = 21


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise QuantreeError(
            f"ONNX export needs the onnx and onnxscript packages ({error}); install them with "
            "pip install 'quantree[onnx]'"
        ) from None


def export_onnx(
    ref: fx.GraphModule,
    example_args: tuple[Any, ...],
    path: str | os.PathLike[str],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    opset: int | None = None,
    target: OnnxTarget = OnnxTarget.QDQ,
) -> Path:
    """Write the reference graph ``ref`` (``qt.convert`` output) to ``path`` as QDQ ONNX.

    A model ``qt.quantize`` or ``qt.lower`` lowered to a backend is exported from the
    reference graph it keeps.

    ``example_args`` are the inputs the graph is exported with (as for ``torch.export``).
    A dimension varies in ONNX where it varies in ``ref`` (captured with ``dynamic_shapes``);
    ``dynamic_shapes`` here may fix more, never free one ``ref`` fixed (see ``shapes``).
    Every tensor leaf of the output, nested ones included (``(out, (h, c))``), is one ONNX
    output, named ``output`` or ``output_<path>`` (``output_1_0`` for ``h``). ``opset``
    defaults to the exporter's, or 21 when the graph quantizes to int16. ``target`` (see
    ``target``): standard QDQ for any runtime, or ONNX Runtime's integer recurrent operators.
    Returns the path written.
    """
    _require_onnx()
    writable_destination(path, "export ONNX")
    if isinstance(ref, fx.GraphModule):
        ref = reference_of(ref) or ref  # what qt.quantize and qt.lower lowered keeps its reference
    if not isinstance(ref, fx.GraphModule) or ref.meta.get(STAGE_KEY) != CONVERTED:
        stage = stage_of(ref) if isinstance(ref, fx.GraphModule) else type(ref).__name__
        raise QuantreeError(
            f"export_onnx needs the reference graph qt.convert returns (or a model qt.quantize "
            f"or qt.lower returned), got a {stage} model"
        )
    if not isinstance(target, OnnxTarget):
        raise QuantreeError(f"target must be a qt.OnnxTarget (QDQ or ONNXRUNTIME), got {target!r}")
    if not isinstance(example_args, tuple):
        raise QuantreeError(
            f"example_args must be a tuple of the model's positional arguments, got "
            f"{type(example_args).__name__}; write (x,) for a single input"
        )
    from quantree.backends.onnx.recurrent import rewrite_recurrent
    from quantree.backends.onnx.shapes import (
        captured_dynamic_shapes,
        check_exported_dims,
        pin_numeric_dims,
    )

    gm = copy_graph_module(ref)
    rewrite_recurrent(gm)
    bias_apart(gm)  # a float bias ONNX Runtime would quantize to int32 and clamp
    kwargs = dict(example_kwargs or {})
    if dynamic_shapes is None:
        dynamic_shapes = captured_dynamic_shapes(ref, example_args, kwargs)
    # a view as example: export guards its _base, which torch.onnx's decomposition then
    # failed on ('NoneType' object has no attribute 'size')
    example_args, kwargs = unaliased(example_args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(gm, example_args, kwargs, dynamic_shapes=dynamic_shapes)
        except Exception as error:
            raise QuantreeError(
                f"torch.export could not trace the reference graph for ONNX: {_first(error)}"
            ) from error
    check_exported_dims(ref, program)
    if opset is None and _needs_int16(ref):
        opset = INT16_OPSET
    opset = int4_opset(ref, opset)  # 4-bit weights: int4 QDQ from opset 21
    table = _translations()
    missing = _untranslatable(program, table)
    names = _output_names(program)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            onnx_program = torch.onnx.export(
                program,
                dynamo=True,
                custom_translation_table=table,
                opset_version=opset,
                output_names=names,
                verbose=False,
            )
        except Exception as error:
            where = f"; ops with no ONNX translation: {'; '.join(missing)}" if missing else ""
            raise QuantreeError(
                f"torch.onnx.export failed on the reference graph{where}: {_first(error)}"
            ) from error
    assert onnx_program is not None
    pin_numeric_dims(onnx_program.model)
    written = Path(path)
    onnx_program.save(str(written))
    finish_export(written, target)
    if has_int4_weights(ref):
        int4_initializers(written)
    return written


def _first(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _needs_int16(gm: fx.GraphModule) -> bool:
    """Whether a quantize or dequantize works on 16 bits: an int16 embedding table is stored
    already quantized, so only its dequantize says so."""
    graphs = [gm, *nested_graphs(gm).values()]
    return any(
        node.op == "call_function"
        and node.target in (*QUANTIZE_OPS, *DEQUANTIZE_OPS)
        and node.args[-1] in (torch.int16, torch.uint16)
        for g in graphs
        for node in g.graph.nodes
    )


def _translations() -> dict[Any, Any]:
    from quantree.backends.onnx import ops

    return {
        torch.ops.quantree_onnx.lstm.default: ops.onnx_lstm,
        torch.ops.quantree_onnx.gru.default: ops.onnx_gru,
        torch.ops.quantree_onnx.rnn.default: ops.onnx_rnn,
        QUANTIZE_PER_TENSOR: ops.onnx_quantize_per_tensor,
    }


def _untranslatable(program: torch.export.ExportedProgram, table: Mapping[Any, Any]) -> list[str]:
    """The nodes whose op neither torch_lib, nor a decomposition, nor ``table`` translates."""
    try:
        from torch.onnx._internal.exporter import _decomp, _registration

        registry = _registration.ONNXRegistry.from_torchlib()
        decomps = _decomp.create_onnx_friendly_decomposition_table(
            set(_decomp.get_onnx_implemented_overloads(registry))
        )
    except Exception:  # private API moved: the exporter's own error is all we have
        return []
    missing = []
    for node in program.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if registry.is_registered(target) or target in table or target in decomps:
            continue
        if target._schema.name.startswith("aten::_assert") or "sym" in target._schema.name:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        scope = str(list(stack.values())[-1][0]) if stack else ""
        where = f" in module {scope!r}" if scope else ""
        missing.append(f"node {node.name} ({target}){where}")
    return missing


def _output_names(program: torch.export.ExportedProgram) -> list[str]:
    spec = program.call_spec.out_spec
    if spec is None:
        return []
    dummy = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    flat = pytree.tree_flatten_with_path(dummy)[0]
    names = []
    for key_path, _ in flat:
        parts = [str(getattr(k, "idx", getattr(k, "key", getattr(k, "name", k)))) for k in key_path]
        names.append(
            "output"
            if not parts or (parts == ["0"] and len(flat) == 1)
            else "output_" + "_".join(parts)
        )
    return names


def run_onnx(
    path: str | os.PathLike[str],
    args: Sequence[torch.Tensor],
    *,
    threads: int | None = None,
    int8_kernels: bool | None = None,
) -> list[torch.Tensor]:
    """Run an exported model once in ONNX Runtime; its outputs as tensors, in leaf order
    (``int8_kernels``: see ``onnx_session``)."""
    session = onnx_session(path, threads=threads, int8_kernels=int8_kernels)
    feeds = {i.name: a.detach().numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


def _warn_saturating_ops(path: str | os.PathLike[str]) -> None:
    """Name the explicit integer operators whose full-range weights overflow here, and the fix:
    no session option sends them back to float, only a model quantized with narrower weights
    gives the reference's numbers on such a CPU."""
    import onnx

    found = saturating_ops(onnx.load(str(path)))
    if found:
        warnings.warn(
            f"{len(found)} integer operator(s) of {os.fspath(path)!r} read full-range int8 "
            f"weights, whose u8 x s8 pair sums saturate in ONNX Runtime on this CPU (x86 "
            f"without VNNI): {', '.join(found)}. Their outputs will differ from the "
            "reference's. For CPUs like this one, quantize with 7-bit weights: "
            "qt.Int8Quantizer(reduce_range=True) (ONNX Runtime's reduce_range), then export "
            "again.",
            QuantreeWarning,
            stacklevel=3,
        )


def onnx_session(
    path: str | os.PathLike[str],
    *,
    threads: int | None = None,
    int8_kernels: bool | None = None,
) -> Any:
    """An ONNX Runtime CPU session for ``path`` (all graph optimizations on, float MatMulNBits).

    ``int8_kernels``: let ONNX Runtime fuse q/dq pairs into its integer operators. ``None``
    (the default) does so where they give the reference's numbers and, on x86 CPUs without
    VNNI, where they saturate (``ort_kernels.py``), runs the q/dq operators as written
    instead, with one warning; ``True`` fuses anyway (speed over exact numbers there)."""
    try:
        import onnxruntime as ort
    except ImportError as error:
        raise QuantreeError(
            f"running ONNX needs onnxruntime ({error}); pip install 'quantree[onnx]'"
        ) from None
    options = ort.SessionOptions()
    # ONNX Runtime fuses dequantize(int8 weight) -> MatMul into MatMulNBits, which by default
    # (accuracy level 4) rounds its float input to int8 first: an int16 input (what weights
    # read in a transformer) loses most of its extra precision there (benchmarks/README.md).
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if int8_kernels is None and ort_int8_saturates():
        warnings.warn(
            "ONNX Runtime's int8 kernels saturate on this CPU (x86 without VNNI: u8 x s8 "
            "pair sums overflow int16 at full-range int8 weights), so this session runs the "
            "q/dq operators as written, with the reference's numbers, instead of fusing them. "
            "Pass int8_kernels=True to onnx_session/run_onnx for ONNX Runtime's fused "
            "integer operators anyway (faster, not the reference's numbers here), or "
            "int8_kernels=False to ask for the exact path and silence this warning.",
            QuantreeWarning,
            stacklevel=2,
        )
        int8_kernels = False
    if int8_kernels is False:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if int8_kernels is not True and ort_int8_saturates():
        _warn_saturating_ops(path)
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
