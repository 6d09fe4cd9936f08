"""vocabulary: the closed set of ops a saved program may call.

A ``.pt2`` names its ops by string and ``torch.export.load`` resolves each by walking
attributes of ``torch``, ``operator`` or ``math``: a file can call ``aten.from_file`` (read
any file, or map it writable), ``aten.copy_`` into it (write any file), ``torch.save``,
random, distributed or storage ops. So a program is accepted only if every node calls an op
of quantree's dialect, decided here from quantree's side, not the file's:

- ``quantree::`` ops (every one is functional) and the ``quantized_decomposed`` q/dq ops;
- ATen ops that are functional by their schema (no argument written, none aliased for
  writing) and either in the Core ATen opset, pointwise (``torch.Tag.pointwise``: each
  output element from the same elements of the inputs, sizes by broadcasting), or among the
  composite ops capture keeps and lowering emits (:data:`ATEN_COMPOSITE`); never random
  ones (``nondeterministic_seeded``, except the recurrent layers, dropout and attention
  with their dropout off: :data:`SEEDED`), never one taking a string besides the few named
  in :data:`STRING_ARGUMENTS`, never the storage and stride ops in :data:`ATEN_REFUSED`;
- in-place ATen ops whose functional form is accepted, only on a tensor the graph itself
  just made (never an input, a weight, a constant or a view of one: checked on the loaded
  graph by :func:`graph_errors`);
- the ``_operator`` / ``torch.sym_*`` / ``math`` functions torch uses for symbolic sizes.

Names are checked on the file's JSON before torch resolves them (:func:`target_error`), and
the resolved graph again after loading (:func:`graph_errors`), before anything runs.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


ATEN_COMPOSITE = _names(
    """
    _assert_scalar _assert_tensor_metadata _pack_padded_sequence _pad_packed_sequence
    _unsafe_view adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool1d
    adaptive_max_pool2d alias_copy argmax argmin atleast_1d atleast_2d avg_pool1d batch_norm
    broadcast_to chunk concat concatenate contiguous conv1d conv2d conv3d conv_transpose1d
    conv_transpose2d conv_transpose3d cumsum detach dropout einsum elu embedding expand_as
    feature_dropout flatten gelu group_norm gru gru_cell hardsigmoid hardswish hardtanh
    index_select instance_norm layer_norm leaky_relu lift_fresh_copy linear log_softmax lstm
    lstm_cell masked_fill matmul max_pool1d max_pool2d max_pool3d mish narrow new_full
    new_ones new_zeros ones_like pad pixel_shuffle pixel_unshuffle relu6 repeat_interleave
    reshape rms_norm rnn_relu rnn_relu_cell rnn_tanh rnn_tanh_cell rsub
    scaled_dot_product_attention selu silu softmax softplus split split_with_sizes square
    squeeze std swapaxes swapdims sym_constrain_range_for_size t tensor_split tile to
    topk transpose mT tril triu type_as unbind unflatten unsafe_chunk unsafe_split
    upsample_bilinear2d
    upsample_nearest2d var view_as where zeros_like _log_softmax _softmax _to_copy addmm
    alias baddbmm bmm clamp clone convolution copy div empty erf exp expand full hardtanh
    max max_pool2d_with_indices mean mm mul native_batch_norm native_group_norm
    native_layer_norm neg new_empty ones permute pow relu rsqrt select sigmoid slice sqrt
    stack sub sum sym_size tanh zeros arange cat add where masked_fill gt lt ge le eq ne
    logical_not logical_and logical_or bitwise_not abs minimum maximum amax amin
    _native_batch_norm_legit_no_training _native_batch_norm_legit empty_like item
    _local_scalar_dense
    roll im2col unfold glu clamp_min clamp_max logsumexp var_mean remainder fmod cumprod
    replication_pad1d replication_pad2d replication_pad3d upsample_nearest1d
    upsample_linear1d upsample_nearest3d upsample_trilinear3d _upsample_nearest_exact1d
    _upsample_nearest_exact2d adaptive_avg_pool3d logcumsumexp cummax cummin prelu
    _prelu_kernel reshape_as view_as
    log_sigmoid linalg_vector_norm cosine_similarity cdist std_mean channel_shuffle outer
    argsort
    """
)
"""ATen ops quantree's capture keeps or its lowering emits beyond the Core ATen opset
(composites torch.export preserves: ``linear``, ``conv2d``, ``lstm``, ``layer_norm``...),
and outside models' float ops between quantized layers (``roll`` in shifted-window
attention, ``im2col`` from ``F.unfold``, ``glu``; ``log_sigmoid`` in xLSTM's gates,
``linalg_vector_norm`` from ``F.normalize``, ``cdist``, ``argsort``): functional,
deterministic, and taking only tensors and numbers, with every size checked by ATen and
charged on fake tensors at load."""
ATEN_REFUSED = _names(
    """
    as_strided as_strided_copy as_strided_scatter set resize resize_as empty_strided
    new_empty_strided from_file
    """
)
"""Ops refused even though functional: views at strides the file chooses, storage ops."""
STRING_ARGUMENTS = {
    "gelu": {"approximate"},
    "div": {"rounding_mode"},
    "einsum": {"equation"},
    "pad": {"mode"},
    "_assert_scalar": {"assert_msg"},
    "_assert_tensor_metadata": set(),
    "scatter_reduce": {"reduce"},
    "index_reduce": {"reduce"},
    "searchsorted": {"side"},
    "upsample_bilinear2d": set(),
    **{f"conv{d}d": {"padding"} for d in (1, 2, 3)},  # "same" / "valid"
}
"""The string arguments an ATen op may take (a path, a name to look up, is refused)."""
SEEDED: dict[str, tuple[str, object]] = {
    **{name: ("train", False) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu", "dropout")},
    "feature_dropout": ("train", False),
    "scaled_dot_product_attention": ("dropout_p", 0.0),
}
"""Ops torch tags random that are deterministic with one argument so (checked per node)."""
WINDOW_LIMIT = 1 << 16
"""The largest kernel, dilation, padding or stride a sliding-window op of a file may take."""
WINDOW_ARGUMENTS: dict[str, dict[str, int]] = {
    name: {"kernel_size": 1, "dilation": 1, "padding": 0, "stride": 1}
    for name in ("im2col", "col2im")
}
"""``F.unfold`` / ``F.fold`` (a dual-path RNN's chunking and overlap-add): their window
arguments, each two ints from the least allowed here to :data:`WINDOW_LIMIT`. ATen checks
them only against the shapes of a call; this holds whatever shapes the file is run on."""
Q_DQ = _names(
    """
    quantize_per_tensor dequantize_per_tensor quantize_per_channel dequantize_per_channel
    quantize_per_token dequantize_per_token quantize_per_channel_group
    dequantize_per_channel_group choose_qparams choose_qparams_symmetric
    choose_qparams_per_token choose_qparams_per_token_asymmetric convert_element_type
    fake_quant_per_channel
    """
)
"""The ``quantized_decomposed`` ops of pt2e's dialect (quantree's reference graph)."""
SYMBOLIC = {
    "_operator": _names(
        "getitem add sub mul floordiv truediv mod neg pos eq ne lt le gt ge and_ or_ not_"
    ),
    "math": frozenset({"trunc", "floor", "ceil", "sqrt"}),
    "torch": _names("sym_int sym_float sym_max sym_min sym_not sym_ite sym_sqrt sym_sum"),
}
"""Python functions torch serializes for symbolic sizes, by module."""
_OP_NAME = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)")


def _written(op: OpOverload) -> bool:
    schema = op._schema
    return schema.is_mutable or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _functional_form(op: OpOverload) -> OpOverload | None:
    """``aten.add.Tensor`` for ``aten.add_.Tensor`` (an in-place op writing only ``self``)."""
    name = op._schema.name.split("::")[1]
    args = op._schema.arguments
    writes = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    if not name.endswith("_") or len(writes) != 1 or writes[0] is not args[0]:
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = op._overloadname
    return getattr(packet, overload, None) if packet is not None else None


def op_error(op: Any) -> str | None:
    """Why a node may not call ``op`` (None: it may)."""
    if not isinstance(op, OpOverload):
        for module_name, names in SYMBOLIC.items():
            module = {"_operator": operator, "math": math, "torch": torch}[module_name]
            if any(getattr(module, name, None) is op for name in names):
                return None
        return "not an op of quantree's dialect"
    namespace = op.namespace
    packet = op._schema.name.split("::")[1]
    if namespace == "quantree":
        return "writes its arguments" if _written(op) else None
    if namespace == "quantized_decomposed":
        return None if packet in Q_DQ and not _written(op) else "not a q/dq op of pt2e's dialect"
    if namespace != "aten":
        return f"an op of the {namespace!r} namespace, outside quantree's dialect"
    if _written(op):
        functional = _functional_form(op)
        if functional is None or op_error(functional) is not None:
            return "writes its arguments (mutation)"
        return None  # where it writes is checked on the graph (graph_errors)
    if packet in ATEN_REFUSED:
        return "a file, storage or stride op"
    if torch.Tag.nondeterministic_seeded in op.tags and packet not in SEEDED:
        return "random"
    allowed_strings = STRING_ARGUMENTS.get(packet, set())
    for arg in op._schema.arguments:
        if "str" in str(arg.type) and arg.name not in allowed_strings:
            return f"takes a string ({arg.name})"
    if not ({torch.Tag.core, torch.Tag.pointwise} & set(op.tags)) and packet not in ATEN_COMPOSITE:
        return "an ATen op outside the Core ATen opset that quantree does not emit"
    return None


def _resolve(target: str) -> Any:
    """The op a serialized target names, resolved only inside the allowed namespaces."""
    match = _OP_NAME.fullmatch(target)
    if match is not None:
        namespace, packet, overload = match.groups()
        if namespace not in ("aten", "quantree", "quantized_decomposed"):
            return None
        try:
            return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        except (AttributeError, RuntimeError):
            return None
    module_name, _, name = target.rpartition(".")
    if name in SYMBOLIC.get(module_name, ()):
        module = {"_operator": operator, "math": math, "torch": torch}[module_name]
        return getattr(module, name, None)
    return None


def target_error(target: object) -> str | None:
    """Why a serialized node target (``torch.ops.aten.add.Tensor``) is refused."""
    if not isinstance(target, str) or len(target) > 200:
        return "not an op name"
    op = _resolve(target)
    if op is None:
        return "not an op of quantree's dialect"
    return op_error(op)


def serialized_nodes(value: Any, where: str = "graph") -> Iterator[tuple[str, str, Any]]:
    """``(node name, role, target)`` of every node and operator argument in a serialized
    program (subgraphs included), without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "target" in item and "inputs" in item:
                yield str(item.get("name") or "?"), "calls", item["target"]
            if "as_operator" in item:
                yield str(item.get("name") or "?"), "passes", item["as_operator"]
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def program_json_error(program: Any) -> str | None:
    """The first refused node of a serialized program, as ``node N calls OP: why``."""
    for name, role, target in serialized_nodes(program):
        why = target_error(target)
        if why is not None:
            return f"node {name} {role} {str(target)[:120]}: {why}"
    return None


def _aliases(node: fx.Node) -> bool:
    """``node``'s output may share memory with its first argument (a view, an in-place op,
    an element of a tuple of views)."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, OpOverload):
        return False
    return any(r.alias_info is not None for r in target._schema.returns) or _written(target)


def graph_made(node: object) -> bool:
    """``node`` is memory the graph made: an op's fresh result, or a view of or in-place
    write into one (never an input, a weight, a constant, or a view of one)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and _aliases(node):
        node = node.args[0] if node.args else None
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    return isinstance(node.target, OpOverload)


def graph_errors(gm: fx.GraphModule) -> Iterator[str]:
    """Every refused node of a loaded graph and its submodules, as one-line reasons."""
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op != "call_function":
                yield f"node {node.name} is a {node.op} node, outside quantree's dialect"
                continue
            op = node.target
            why = op_error(op)
            if why is not None:
                yield f"node {node.name} calls {op}: {why}"
                continue
            if (
                isinstance(op, OpOverload)
                and _written(op)
                and not (node.args and graph_made(node.args[0]))
            ):
                yield (
                    f"node {node.name} calls {op}: writes in place into "
                    f"{node.args[0] if node.args else 'nothing'}, which the graph did "
                    "not make"
                )
            window = _window_error(op, node)
            if window is not None:
                yield f"node {node.name} calls {op} with {window}"
            placement = _placement_error(node)
            if placement is not None:
                yield f"node {node.name} calls {op} {placement}"
            seeded = (
                SEEDED.get(op._schema.name.split("::")[1]) if isinstance(op, OpOverload) else None
            )
            if seeded is not None and _argument(op, node, seeded[0]) != seeded[1]:
                value = _argument(op, node, seeded[0])
                yield f"node {node.name} calls {op} with {seeded[0]}={value}: random"


def _window_error(op: object, node: fx.Node) -> str | None:
    """The first window argument of an ``im2col`` / ``col2im`` node out of its bounds."""
    if not isinstance(op, OpOverload):
        return None
    bounds = WINDOW_ARGUMENTS.get(op._schema.name.split("::")[1])
    for name, least in (bounds or {}).items():
        value = _argument(op, node, name)
        if not (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(type(v) is int and least <= v <= WINDOW_LIMIT for v in value)
        ):
            return (
                f"{name}={str(value)[:80]}: two ints from {least} to {WINDOW_LIMIT} expected "
                "(re-save the model from its source)"
            )
    return None


def _placement_error(node: fx.Node) -> str | None:
    """Where a node would put its result, if not in ordinary CPU memory: another device
    (a CUDA context, or ``meta`` tensors with no data), pinned memory, a sparse layout."""
    for key, value in [*enumerate(node.args), *node.kwargs.items()]:
        if isinstance(value, torch.device) and value.type != "cpu":
            return f"on device {value}"
        if key == "pin_memory" and value:
            return "with pinned memory"
        if isinstance(value, torch.layout) and value != torch.strided:
            return f"with layout {value}"
    return None


def _argument(op: OpOverload, node: fx.Node, name: str) -> object:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


_HELD_INPUTS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR", "USER_INPUT")


def program_errors(program: torch.export.ExportedProgram) -> Iterator[str]:
    """Every refused part of a loaded program: inputs other than tensors and user inputs,
    outputs other than user outputs (a buffer or input mutation makes ``module()`` write
    into it), and the graph's refused nodes."""
    signature = program.graph_signature
    for spec in signature.input_specs:
        if spec.kind.name not in _HELD_INPUTS:
            yield f"input {spec.arg.name} is a {spec.kind.name.lower()}, outside quantree's dialect"
    for spec in signature.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            yield f"output {spec.arg.name} is a {spec.kind.name.lower()} (a mutation)"
    yield from graph_errors(program.graph_module)
