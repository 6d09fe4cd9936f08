"""Rewrite quantree's reference graph into the q/dq dialect ExecuTorch's XNNPACK backend fuses.

The reference graph is pt2e's dialect, but not every q/dq pattern in it is one XNNPACK's
partitioner recognises as a quantized op, and some it takes and computes wrongly. What
differs from what ExecuTorch's own ``XNNPACKQuantizer`` + ``convert_pt2e`` emit, and what
this pass changes so the numbers stay the reference's:

- **int32 biases.** quantree quantizes a conv/linear bias to int32 on the grid input scale x
  weight scale (a ``dequantize_per_channel`` of an int32 constant); ``convert_pt2e`` leaves
  the bias float. XNNPACK's quantized conv/linear take the bias as a float constant and
  quantize it themselves on that grid (with the int32 dequantize left in front of the bias
  the lowered program computes wrong numbers), and a dequantize of int32 has no out-variant
  kernel in ExecuTorch's portable or quantized libraries. Each such dequantize is folded to
  its float value: XNNPACK re-quantizes it to the integers it came from. A bias convert kept
  float because int32 cannot hold it on that grid (``backends/float_bias.py``) would be cut
  by XNNPACK's quantization: its layer runs in fp32, as the next item says.
- **Weights of layers XNNPACK cannot run as int8.** XNNPACK's static int8 conv/linear is
  ``dq(int8 act) -> op(dq(int8 weight)) [-> relu|hardtanh] -> q(int8)``. A layer whose input
  is int16 (the w8a16 recipe for transformers), or whose output is not quantized (only
  weighted inputs quantized), does not match; its weight dequantize would stay a portable op
  that dequantizes the whole weight on every call. Its weight is folded to the float values
  it dequantizes to, so XNNPACK runs the layer in fp32 on exactly the reference's weights
  (the activation's q/dq pair stays, as portable ops, so the numbers are still the
  reference's). :func:`fp32_layers` names these layers.
- **Whole-mode recurrent layers** (LSTM, GRU, RNN; stacked, bidirectional) become one
  ``quantree_et::rnn`` node each, run by quantree's ExecuTorch kernel library
  (:mod:`.recurrent` says how and why); XNNPACK takes the rest.
- **Other dequantized constants** (an embedding table, a matrix product's constant operand)
  are folded to their float values for the same reason.
- **Shared dequantize nodes.** The reference dequantizes a value once for all its users;
  XNNPACK partitions a dequantize with the op reading it, so one shared by two partitions
  makes a dependency cycle (mobilenet_v2 fails to partition). Each user gets its own copy,
  as ``convert_pt2e`` does.
- **Constants that are views** (a saved program's constants share one buffer) get storage of
  their own: XNNPACK's serializer reads a view from the start of its storage.
- **``out_dtype=float32``** on dequantize calls (the default, written out) is dropped, so the
  nodes read as ``convert_pt2e``'s.

Everything else (per-tensor int8 activations, per-channel symmetric int8 weights, grids
shared through views, pooling and concatenation) is already what XNNPACK fuses.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.backends.executorch.recurrent import lower_layers
from quantree.backends.float_bias import beyond_int32, bias_apart
from quantree.core.errors import QuantreeError
from quantree.core.graphs import copy_graph_module, drop_attr, fetch_attr, register_constant
from quantree.core.qdq import DEQUANTIZE_PER_TENSOR, QUANTIZE_PER_TENSOR, is_dequantize

aten = torch.ops.aten
FOLDED_PREFIX = "_et_folded_"
LAYER_KEY = "quantree_executorch_fp32"
"""``node.meta`` key set on a conv/linear whose weight was folded to float."""

WEIGHTED = {
    aten.linear.default: "linear",
    aten.conv1d.default: "conv",
    aten.conv2d.default: "conv",
    aten.conv1d.padding: "conv",
    aten.conv2d.padding: "conv",
}
"""Ops XNNPACK's GEMM configs run as static int8: weight at argument 1, bias at 2."""
DEQUANTIZE_DYNAMIC = torch.ops.quantized_decomposed.dequantize_per_tensor.tensor
FUSED_ACTIVATIONS = (aten.relu.default, aten.relu_.default, aten.hardtanh.default)


def _constant_args(gm: fx.GraphModule, node: fx.Node) -> list[object] | None:
    """The dequantize's arguments with every ``get_attr`` read, or None if one is computed."""
    values: list[object] = []
    for arg in node.args:
        if isinstance(arg, fx.Node):
            if arg.op != "get_attr":
                return None
            values.append(fetch_attr(gm, str(arg.target)))
        else:
            values.append(arg)
    return values


def fold_dequantize(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Replace a dequantize of constants by its float value; False if an input is computed."""
    values = _constant_args(gm, node)
    if values is None:
        return False
    value = node.target(*values, **node.kwargs)  # type: ignore[operator]
    name = register_constant(gm, FOLDED_PREFIX, value)
    with gm.graph.inserting_before(node):
        constant = gm.graph.get_attr(name)
    constant.meta = dict(node.meta)
    node.replace_all_uses_with(constant)
    gm.graph.erase_node(node)
    return True


def _is_int8_per_tensor(node: object, target: object) -> bool:
    return isinstance(node, fx.Node) and node.target == target and node.args[5] == torch.int8


def is_xnnpack_int8(layer: fx.Node) -> bool:
    """Whether XNNPACK's static (or dynamic, ``qd8``) int8 GEMM config takes ``layer``."""
    act = layer.args[0]
    if isinstance(act, fx.Node) and act.target == DEQUANTIZE_DYNAMIC:
        weight = layer.args[1]
        return is_dequantize(weight) and weight.args[-1] == torch.int8  # type: ignore[union-attr]
    weight = layer.args[1] if len(layer.args) > 1 else None
    if not _is_int8_per_tensor(act, DEQUANTIZE_PER_TENSOR):
        return False
    if not (is_dequantize(weight) and weight.args[-1] == torch.int8):  # type: ignore[union-attr]
        return False
    if beyond_int32(layer):  # XNNPACK would quantize its float bias to int32 and clamp it
        return False
    if len(layer.users) != 1:
        return False
    (out,) = layer.users
    if out.target in FUSED_ACTIVATIONS and len(out.users) == 1:
        (out,) = out.users
    return _is_int8_per_tensor(out, QUANTIZE_PER_TENSOR)


def fold_wide_dequantize(gm: fx.GraphModule) -> int:
    """Fold each dequantize of an int32 constant (a derived bias); return how many."""
    wide = [n for n in gm.graph.nodes if is_dequantize(n) and n.args[-1] == torch.int32]
    return sum(fold_dequantize(gm, n) for n in wide)


def fold_fp32_weights(gm: fx.GraphModule) -> list[fx.Node]:
    """Fold the weight dequantize of each conv/linear XNNPACK cannot run as int8.

    Returns those layers (marked with :data:`LAYER_KEY`). A weight shared by an int8 and an
    fp32 layer is folded for the fp32 one only (it gets its own float copy)."""
    layers = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in WEIGHTED or len(node.args) < 2:
            continue
        weight = node.args[1]
        if not is_dequantize(weight) or is_xnnpack_int8(node):
            continue
        if len(weight.users) > 1:
            with gm.graph.inserting_before(node):
                own = gm.graph.node_copy(weight)
            node.replace_input_with(weight, own)
            weight = own
        if fold_dequantize(gm, weight):
            node.meta[LAYER_KEY] = True
            layers.append(node)
    return layers


def fold_constant_dequantize(gm: fx.GraphModule) -> int:
    """Fold every dequantize of a constant that no int8 XNNPACK layer reads as its weight.

    Embedding tables and constant operands of matrix products: left in place, each would be
    a portable op dequantizing the whole constant on every call."""
    folded = 0
    for node in list(gm.graph.nodes):
        if not is_dequantize(node) or not isinstance(node.args[0], fx.Node):
            continue
        if node.args[0].op != "get_attr" or any(
            user.target in WEIGHTED and user.args[1] is node and is_xnnpack_int8(user)
            for user in node.users
        ):
            continue
        folded += fold_dequantize(gm, node)
    return folded


def lower_recurrent(gm: fx.GraphModule) -> int:
    """Each int8 whole-mode recurrent layer as one ``quantree_et::rnn`` node (``recurrent``)."""
    return len(lower_layers(gm))


def duplicate_shared_dequantize(gm: fx.GraphModule) -> int:
    """Give each user of a dequantize its own copy; return how many copies were made.

    The reference graph dequantizes a Value once for all its users; ``convert_pt2e`` gives
    each user its own (torchao's ``DuplicateDQPass``). XNNPACK partitions a dequantize with
    the op that reads it, so one shared by two partitions ties them into a cycle."""
    made = 0
    for node in list(gm.graph.nodes):
        if not is_dequantize(node) or len(node.users) < 2:
            continue
        for user in list(node.users)[1:]:
            with gm.graph.inserting_after(node):
                copy = gm.graph.node_copy(node)
            copy.meta = dict(node.meta)
            user.replace_input_with(node, copy)
            made += 1
    return made


def drop_default_out_dtype(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if is_dequantize(node) and node.kwargs.get("out_dtype") == torch.float32:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "out_dtype"}


def drop_unused_attrs(gm: fx.GraphModule) -> None:
    """Constants no node reads any more: torch.export would lift and store each one.

    Only the copy's own top-level buffers are dropped: nested modules may be shared with
    the module the caller handed in, which stays as it was."""
    gm.graph.eliminate_dead_code()
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_buffers(recurse=False)):
        if name not in read:
            drop_attr(gm, name)
    gm.recompile()


def fp32_layers(gm: fx.GraphModule) -> list[str]:
    """Names of the conv/linear nodes of a rewritten graph that XNNPACK runs in fp32."""
    return [n.name for n in gm.graph.nodes if n.meta.get(LAYER_KEY)]


def own_storage(gm: fx.GraphModule) -> int:
    """Give each constant that is a view into a larger storage a copy of its own.

    A program saved by ``quantree quantize`` and loaded again keeps its constants as views
    of one shared buffer; ExecuTorch's XNNPACK serializer reads such a tensor from the
    start of its storage (wrong weights, no error)."""
    copied = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = fetch_attr(gm, str(node.target))
        if value.untyped_storage().nbytes() == value.numel() * value.element_size():
            continue
        node.target = register_constant(gm, FOLDED_PREFIX, value.clone().contiguous())
        copied += 1
    return copied


def refuse_conv1d(layers: list[fx.Node]) -> None:
    """A 1-d convolution whose bias int32 cannot hold runs in fp32 on an int8 input, which
    XNNPACK fails to compile (its squeeze around the 2-d kernel): said here, by name."""
    for layer in layers:
        if layer.target in (aten.conv1d.default, aten.conv1d.padding):
            raise QuantreeError(
                f"node {layer.name} ({layer.target}): its bias is float in the reference graph "
                "(int32 cannot hold it on the grid input scale x weight scale), so XNNPACK "
                "would run this 1-d convolution in fp32 on an int8 input, which it cannot "
                "compile. Give the layer a wider input or weight range (so its int32 bias "
                "fits), or export with qt.export_onnx"
            )


def to_xnnpack_dialect(ref: fx.GraphModule) -> fx.GraphModule:
    """A copy of the reference graph ``ref`` whose q/dq patterns are XNNPACK's (see above)."""
    gm = copy_graph_module(ref)
    own_storage(gm)
    lower_recurrent(gm)
    refuse_conv1d(bias_apart(gm))
    fold_wide_dequantize(gm)
    fold_fp32_weights(gm)
    fold_constant_dequantize(gm)
    duplicate_shared_dequantize(gm)
    drop_default_out_dtype(gm)
    drop_unused_attrs(gm)
    return gm
