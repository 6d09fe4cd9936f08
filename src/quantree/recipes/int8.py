"""The default recipe: int8 activations (affine), int8 per-channel weights, int32 biases.

Over 400 lines: the default recipe's rule table (``int8_rules``) and the two quantizers
built on it read together; the A16W8 variant moves to its own module when it grows.

Each rule is a small function from a node to an Annotation. Nested outputs need nothing
special: an LSTM's annotation is a tuple of specs shaped like its output.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from quantree.core.errors import QuantreeError
from quantree.core.quantizer import Annotation, Quantizer, Rule
from quantree.core.specs import (
    FixedSpec,
    ObserverKind,
    QDtype,
    QuantSpec,
    SharedSpec,
    Spec,
    int8_activation,
    int8_weight,
)
from quantree.core.values import Use, Value, is_float_tensor, tensor_meta
from quantree.recipes.activation_points import (
    ActivationPoints,
    transformer_like,
    weighted_inputs_rules,
)
from quantree.recipes.float_only import on_floats
from quantree.recipes.infinities import off_infinities
from quantree.recipes.padding import PAD_OPS, pad_rule
from quantree.recipes.recurrent import cells_rules, fixed_sigmoid, fixed_tanh
from quantree.recipes.transposed import (
    TRANSPOSED_CONVS,
    is_transposed_convolution,
    transposed_annotation,
)
from quantree.recipes.weighted import weighted_annotation
from quantree.recurrent.call import CELL_OPS, RECURRENT_OPS
from quantree.recurrent.decompose import CellsOptions
from quantree.recurrent.split_layers import RELU_ONLY, SPLITTABLE, split_layers, splittable
from quantree.recurrent.whole import recurrent_cell_annotation, recurrent_whole_annotation

aten = torch.ops.aten


MASK_CARRIERS = (
    *(aten.squeeze, aten.unsqueeze, aten.view, aten.reshape, aten.transpose, aten.permute),
    *(aten.expand, aten.contiguous, aten.clone, aten._to_copy, aten.to, aten.slice),
    *(aten.triu, aten.tril),  # nn.Transformer's causal mask: triu(full(-inf), 1)
)
"""Ops that pass their first operand's values on: an infinity in it stays one."""
MASK_SUMS = (aten.add, aten.add_, aten.sub, aten.sub_, aten.baddbmm)
"""Sums that carry an infinity in any operand to their result (an additive mask)."""


def _masked_with_infinity(arg: object, depth: int = 0) -> bool:
    """``arg`` can hold an infinity a mask put there: a ``masked_fill`` or ``full`` whose
    value is not finite, seen through views and through sums with it. nn.MultiheadAttention
    adds its key padding mask (-inf where padded) to the scores with ``baddbmm``, and
    additive masks are added to scores by hand; no grid holds -inf, so calibration refused
    such a sum or softmax input as "NaN or infinity" (``depth`` bounds the walk)."""
    while isinstance(arg, fx.Node) and getattr(arg.target, "overloadpacket", None) in (
        MASK_CARRIERS
    ):
        arg = arg.args[0]
    if not isinstance(arg, fx.Node) or depth > 8:
        return False
    packet = getattr(arg.target, "overloadpacket", None)
    if packet in MASK_SUMS:
        return any(_masked_with_infinity(a, depth + 1) for a in arg.args[:3])
    if packet in (aten.masked_fill, aten.masked_fill_):
        value = arg.args[2] if len(arg.args) > 2 else None
    elif packet is aten.full:
        value = arg.args[1] if len(arg.args) > 1 else None
    else:
        return False
    return isinstance(value, int | float) and not math.isfinite(value)


BINARY_OPS = (
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.add_.Tensor,
    aten.sub_.Tensor,
    aten.mul_.Tensor,
)
"""Elementwise arithmetic on two tensors: inputs and output quantized."""
SAME_AS_INPUT_OPS = (
    aten.max_pool2d,
    aten.max_pool2d_with_indices,
    aten.max_pool1d,
    aten.hardtanh,
    aten.hardtanh_,
    aten.relu6,
    aten.clamp,
    aten.max.dim,
    aten.chunk,
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.index_select,  # packing's sort by length
    aten._pack_padded_sequence,  # the float rows move; batch sizes stay int64
    aten._pad_packed_sequence,  # padding is 0.0, exact on any affine grid
)
"""Ops whose float outputs keep exactly the input's grid (max, clamp, splits, packing)."""
UNARY_OPS = (
    aten.layer_norm,
    aten.group_norm,
    aten.avg_pool2d,
    aten.adaptive_avg_pool2d,
    aten.mean,
    aten.avg_pool1d,
    aten.adaptive_avg_pool1d,
    aten.gelu,
    aten.glu,  # a * sigmoid(b) of two halves: one int8 pass on the CPU backend
    aten.silu,
    aten.silu_,
    aten.hardswish,
    aten.hardswish_,
    aten.hardsigmoid,
    aten.hardsigmoid_,
    aten.elu,
    aten.elu_,
    aten.leaky_relu,
    aten.leaky_relu_,
)
"""Ops that change the range: input and output quantized separately."""
SUM_OPS = (aten.sum,)
"""A sum over float values changes the range like a mean (MobileViT's separable attention
sums its context vector); a count over a mask is an integer and stays as it is."""
RELU_OPS = (aten.relu, aten.relu_)
NORM_OPS = (aten.batch_norm,)
"""Eval batch norm no conv/linear absorbed (pre-activation norms): input and output, the
output left to a following relu it fuses with, as a convolution's."""
CAT_OPS = (aten.cat, aten.concat, aten.stack)
FLOAT_UNDER_WEIGHTED_INPUTS = (
    *BINARY_OPS,
    *RELU_OPS,
    aten.sigmoid,
    aten.tanh,
    *SAME_AS_INPUT_OPS,
    *CAT_OPS,
    *UNARY_OPS,
    *NORM_OPS,
    *SUM_OPS,
    aten.softmax,
    aten._softmax,
    *PAD_OPS,
)
"""What EVERY_OP quantizes and WEIGHTED_INPUTS leaves float."""


def _is_float_node(arg: object) -> bool:
    return isinstance(arg, fx.Node) and is_float_tensor(tensor_meta(arg))


def _sole_user_is(node: fx.Node, targets: tuple[object, ...]) -> bool:
    users = list(node.users)
    return len(users) == 1 and getattr(users[0].target, "overloadpacket", None) in targets


ACTIVATION_OBSERVER = ObserverKind.SEARCH
"""How int8 activation ranges are calibrated unless the recipe names an observer: each
point's range is chosen among min-max, a margin, percentile clips and the least-error clip
by the error each measures on calibration batches it did not see (``RangeSearchObserver``).
No one rule suits every point: min-max clipped a head on an LSTM's final state (few values
a batch) on new inputs, and spent a CNN's activation grids on outliers; the search takes
min-max where it holds. The ranges change, not the graph: the same kernels run."""

CELL_INTERNALS = QDtype.INT16
"""Cells mode's cell state, gates and sums unless the recipe names another type."""


class RecurrentMode(enum.Enum):
    """WHOLE quantizes a recurrent layer at its boundary; CELLS decomposes it into cell loops
    whose gates, cell state and hidden state are named quantization points."""

    WHOLE = "whole"
    CELLS = "cells"


def cell_state_spec(dtype: QDtype, act: QuantSpec) -> QuantSpec:
    """int16 cell state is symmetric with a power-of-two range (the integer-LSTM convention)."""
    if dtype == act.dtype:
        return act
    return QuantSpec(dtype, symmetric=True, power_of_two=dtype == QDtype.INT16)


def table_spec(weight: QuantSpec, dtype: QDtype) -> QuantSpec:
    """An embedding table at ``dtype``: the weight spec's axis and observer, symmetric."""
    return QuantSpec(dtype, symmetric=True, axis=weight.axis, observer=weight.observer)


def table_chooser(
    embedding_dtype: QDtype | None, weight: QuantSpec, act: QuantSpec, points: ActivationPoints
) -> Callable[[fx.Node], QuantSpec]:
    """The spec of each embedding's table: ``embedding_dtype`` when given, else chosen per
    lookup by where its rows go.

    Where the rows are read in float or at 16 bits (a transformer's embeddings, summed and
    layer-normed in float before int16 linear inputs: ``ActivationPoints``' weighted inputs,
    or 16-bit activations), an int8 row's rounding is the model's largest error: a row of
    8-bit codes cannot come near float's accuracy, 16 bits can. The table is then INT16 per
    row, half a float table's bytes (torchao leaves its tables float). Where every op is
    quantized at 8 bits (an LSTM's token embedding), the rows are rounded to an int8 grid
    by the next op anyway: a wider table buys nothing there and costs twice the bytes, so it
    stays INT8, the weight spec."""
    wide = table_spec(weight, QDtype.INT16)
    if embedding_dtype is QDtype.INT8:
        return lambda node: weight
    if embedding_dtype is QDtype.INT16:
        return lambda node: wide

    def chosen(node: fx.Node) -> QuantSpec:
        if act.dtype not in (QDtype.INT8, QDtype.UINT8):
            return wide
        if points is ActivationPoints.WEIGHTED_INPUTS:
            return wide
        if points is ActivationPoints.AUTO and transformer_like(node.graph):
            return wide
        return weight

    return chosen


def cell_sums_spec(dtype: QDtype, act: QuantSpec) -> QuantSpec:
    """The sums inside a cell: symmetric min-max at 16 bits (no clip pays at that width)."""
    if dtype == act.dtype:
        return act
    return QuantSpec(dtype, symmetric=dtype != QDtype.UINT8)


class Int8Quantizer(Quantizer):
    """int8 static quantization of the common ops; anything else stays in float.

    ``activation_observer`` picks how activation ranges are calibrated (by default int8
    points take ``ObserverKind.SEARCH``, each point's range chosen by measured error, see
    ``ACTIVATION_OBSERVER``; int16 inputs of weighted layers min-max, and 2-d convolutions'
    int8 inputs the histogram's error-minimising range, where only what weights read is
    quantized, see ``ActivationPoints``); an int8 point whose readers all clamp it (a ReLU6
    after a convolution) is calibrated on what they keep (``clamped_spec``);
    ``weight_observer`` likewise for weights (``SEARCH``: each channel's clip by its exact
    error; min-max by default); ``per_channel`` quantizes weights per output channel (else
    per tensor). ``recurrent`` chooses whole or cells mode for LSTM/GRU/RNN; in cells mode
    ``split_gates``, ``cell_state_dtype``,
    ``gate_dtype`` (sigmoid/tanh outputs), ``cell_sums_dtype`` (projections, gate
    pre-activations; each INT16 by default, the integer-LSTM convention: what whole mode's
    kernel keeps in int32 and float; an int8 cell's rounding, fed back every step, was most
    of cells mode's error; pass ``QDtype.INT8`` for the all-int8 cell) and
    ``points`` (a spec per point name, see ``quantree.recurrent.cell_graph``)
    shape the cells, and ``cells_scope`` limits cells mode to one module (the rest stays
    whole). In whole mode a stacked call (``num_layers > 1``) becomes one call per layer at
    prepare (``split_layers=True``, the default), so each layer's output is observed and
    quantized like any other tensor; ``split_layers=False`` keeps the stacked call whole,
    quantized at its boundary only (a stacked ReLU RNN is split either way: nothing bounds
    its inner states). Each state a layer returns (``h_n``, ``c_n``) has its own grid;
    ``share_recurrent_state=True`` puts it on its initial state's grid (stateful streaming,
    where it is fed back as the next call's initial state). ``activations`` says which
    activations are quantized (``ActivationPoints``: by default every op's, except in graphs
    with layer norm or attention, where only what linear/conv/matmul read).
    ``weighted_inputs_dtype`` is the type of those inputs where only they are quantized
    (``weighted_input_spec``: int16 by default, INT8 for torchao's int8 recipe).
    ``embedding_dtype``: embedding tables' type, per row like weights; None (the default)
    chooses per table (``table_chooser``): INT16 where the rows are read in float or at 16
    bits (transformers: about float's accuracy at half its size, where an int8 row's
    rounding was the model's largest error), INT8 where the next op rounds them to int8.
    ``recurrent_sequence_dtype``: the input and output sequences of whole-mode recurrent
    layers (INT16: symmetric; at int8 the output grid was most of an LSTM's error, 3 dB
    under ONNX Runtime's dynamic LSTM, and INT16 gains 7-10 dB on the CPU backend; the
    native kernel reads and writes the int16 sequences as byte planes and floats. INT8 by
    default while ONNX Runtime's integer LSTM (``OnnxTarget.ONNXRUNTIME``) refuses a 16-bit
    input; benchmarks/README.md, branch ``lstmb1``).
    ``conv1d_weight_dtype``: the weights of 1-d convolutions that read a 16-bit input
    (``WEIGHTED_INPUTS``); INT16 (the default) widens them (``wide_weight``: Conformer's
    convolution module), None or INT8 keeps the weight spec. A bias's int32 scale is then the
    product of two 16-bit scales, which an ordinary bias can pass: convert keeps such a bias
    float with a warning rather than clamp it (HDemucs' clamped biases cost it 14 dB before;
    benchmarks/README.md, "Stop 38" and "h-bias32").
    ``reduce_range``: weights on [-63, 63] (7 bits, ONNX Runtime's ``reduce_range``), for a
    model deployed to ONNX Runtime on x86 CPUs without VNNI, whose int8 kernels saturate on
    full-range weights (``quantree.backends.onnx.ort_kernels``); other runtimes and the CPU
    backend are exact at 8 bits. On x86 CPUs with AVX2 and no VNNI it also speeds up the CPU
    backend's convolutions and linears (a `vpmaddubsw` kernel, exact for 7-bit weights only,
    chosen from the packed weight's range; benchmarks/README.md, "h-u8s8"), at the accuracy
    the halved weight grid costs: measure both on the model. Elsewhere it only costs
    accuracy. ``rules``
    are added last and so take precedence.
    """

    def __init__(
        self,
        *,
        activation_observer: ObserverKind | None = None,
        weight_observer: ObserverKind = ObserverKind.MINMAX,
        per_channel: bool = True,
        activation: QuantSpec | None = None,
        weight: QuantSpec | None = None,
        recurrent: RecurrentMode = RecurrentMode.WHOLE,
        split_gates: bool = False,
        cell_state_dtype: QDtype | None = None,
        gate_dtype: QDtype | None = None,
        cell_sums_dtype: QDtype | None = None,
        points: Mapping[str, Spec] | None = None,
        cells_scope: str | None = None,
        share_recurrent_state: bool = False,
        split_layers: bool = True,
        activations: ActivationPoints = ActivationPoints.AUTO,
        weighted_inputs_dtype: QDtype = QDtype.INT16,
        embedding_dtype: QDtype | None = None,
        recurrent_sequence_dtype: QDtype = QDtype.INT8,
        reduce_range: bool = False,
        conv1d_weight_dtype: QDtype | None = QDtype.INT16,
        rules: tuple[Rule, ...] = (),
    ) -> None:
        if not isinstance(recurrent, RecurrentMode):
            raise QuantreeError(f"recurrent must be a RecurrentMode, got {recurrent!r}")
        if not isinstance(activations, ActivationPoints):
            raise QuantreeError(f"activations must be an ActivationPoints, got {activations!r}")
        if weighted_inputs_dtype not in (QDtype.INT8, QDtype.INT16):
            raise QuantreeError(
                f"weighted_inputs_dtype must be QDtype.INT8 or QDtype.INT16, got "
                f"{weighted_inputs_dtype!r}"
            )
        act = activation or int8_activation(activation_observer or ACTIVATION_OBSERVER)
        weighted_act = activation or weighted_input_spec(weighted_inputs_dtype, activation_observer)
        if not isinstance(weight_observer, ObserverKind):
            raise QuantreeError(f"weight_observer must be an ObserverKind, got {weight_observer!r}")
        wgt = weight or int8_weight(0 if per_channel else None, weight_observer)
        if not isinstance(reduce_range, bool):
            raise QuantreeError(f"reduce_range must be True or False, got {reduce_range!r}")
        if reduce_range:
            wgt = reduced_range(wgt)
        if not isinstance(share_recurrent_state, bool):
            raise QuantreeError(
                f"share_recurrent_state must be True or False, got {share_recurrent_state!r}"
            )
        if not isinstance(split_layers, bool):
            raise QuantreeError(f"split_layers must be True or False, got {split_layers!r}")
        image_act = activation or weighted_input_spec(QDtype.INT8, activation_observer)
        if embedding_dtype not in (None, QDtype.INT8, QDtype.INT16):
            raise QuantreeError(
                f"embedding_dtype must be None (chosen per table), QDtype.INT8 or QDtype.INT16, "
                f"got {embedding_dtype!r}"
            )
        table = table_chooser(embedding_dtype, wgt, act, activations)
        if recurrent_sequence_dtype not in (QDtype.INT8, QDtype.INT16):
            raise QuantreeError(
                f"recurrent_sequence_dtype must be QDtype.INT8 or QDtype.INT16, got "
                f"{recurrent_sequence_dtype!r}"
            )
        sequence = (  # the observer asked for, on a symmetric int16 grid
            dataclasses.replace(
                act, dtype=QDtype.INT16, symmetric=True, quant_min=None, quant_max=None
            )
            if recurrent_sequence_dtype is QDtype.INT16 and activation is None
            else None
        )
        if conv1d_weight_dtype not in (None, QDtype.INT8, QDtype.INT16):
            raise QuantreeError(
                f"conv1d_weight_dtype must be None (the weight spec), QDtype.INT8 or "
                f"QDtype.INT16, got {conv1d_weight_dtype!r}"
            )
        wide_conv1d = conv1d_weight_dtype is QDtype.INT16
        recipe = int8_rules(
            act, wgt, share_recurrent_state, split_layers, table, sequence
        ) + weighted_inputs_rules(
            weighted_act,
            wgt,
            activations,
            FLOAT_UNDER_WEIGHTED_INPUTS,
            image_act,
            wide_weight(wgt) if wide_conv1d and weighted_act.dtype is QDtype.INT16 else None,
        )
        if recurrent is RecurrentMode.CELLS:
            cell_state = cell_state_spec(cell_state_dtype or CELL_INTERNALS, act)
            recipe += cells_rules(
                act,
                wgt,
                cell_state,
                gate_dtype or CELL_INTERNALS,
                CellsOptions(split_gates),
                points or {},
                cells_scope,
                cell_sums_spec(cell_sums_dtype or CELL_INTERNALS, act),
            )
        recipe = tuple(off_infinities(on_floats(rule)) for rule in recipe)
        super().__init__((*recipe, *rules))  # the user's rules as given


def wide_weight(weight: QuantSpec) -> QuantSpec:
    """``weight`` at 16 bits (same axis and observer), for the layers whose 8-bit weights are
    their accuracy bound: a 1-d convolution reading a 16-bit input (``conv1d_weight_dtype``).
    There the input's rounding is 2**8 times finer than the weights', so the weights are
    the layer's error, and Conformer's convolution module (its output added to the residual
    unscaled) was most of the model's; the CPU backend runs such a layer natively
    (``quantree.backends.cpu.ops.conv1d_w16``) at the cost of the int16-input kernel it
    replaces (figures: benchmarks/README.md, "h-conf27")."""
    if weight.dtype is not QDtype.INT8 or weight.group_size is not None or weight.range[1] < 127:
        return weight  # 4-bit, grouped or 7-bit weights were asked for: never widened
    return dataclasses.replace(weight, dtype=QDtype.INT16, quant_min=None, quant_max=None)


REDUCED_WEIGHT_MAX = 63
"""7-bit weights: two u8 x s8 products sum to at most 2 x 255 x 63 < 2**15, so an int16
pair sum (x86's ``vpmaddubsw``) cannot saturate. Symmetric, so -w still quantizes like w."""


def reduced_range(weight: QuantSpec) -> QuantSpec:
    """``weight`` narrowed to 7 bits (never widened: a 4-bit spec stays 4-bit)."""
    lo, hi = weight.range
    return dataclasses.replace(
        weight, quant_min=max(lo, -REDUCED_WEIGHT_MAX), quant_max=min(hi, REDUCED_WEIGHT_MAX)
    )


def weighted_input_spec(dtype: QDtype, observer: ObserverKind | None) -> QuantSpec:
    """What linear/conv read where nothing else is quantized (``WEIGHTED_INPUTS``).

    int16 by default (w8a16, symmetric, min-max): with the residual stream, norms and
    attention float, these inputs are the only activation error left, and at 8 bits it was
    most of the error; at 16 bits it is about what float activations give, more than
    torchao's per-token dynamic int8 recovers. The CPU backend runs these layers on the int8
    kernels, one pass per byte of the input (``backends/cpu/ops/wide.py``). 2-d
    convolutions read INT8 even so (the recipe's ``image_act``): a convolution pays that
    second pass in full, which cost an image model its speed-up over float, and on images
    the int8 recipe was already level with torchao's. (The figures: benchmarks/README.md,
    "Recipe choices" and "Accuracy on the transformers".) INT8 is the int8
    recipe torchao's X86 quantizer makes: long-tailed inputs (layer-norm, GELU, attention
    outputs), so the histogram's range that minimises the expected error unless ``observer``
    says otherwise.
    """
    if dtype is QDtype.INT16:
        return QuantSpec(QDtype.INT16, symmetric=True, observer=observer or ObserverKind.MINMAX)
    return int8_activation(observer or ObserverKind.HISTOGRAM)


class A16W8Quantizer(Int8Quantizer):
    """16-bit symmetric activations, 8-bit per-channel weights, int32 biases (a16w8).

    In cells mode the gates and the cell state are int16 too.
    """

    def __init__(self, **options: Any) -> None:
        options.setdefault("activation", QuantSpec(QDtype.INT16, symmetric=True))
        options.setdefault("cell_state_dtype", QDtype.INT16)
        options.setdefault("gate_dtype", QDtype.INT16)
        super().__init__(**options)


def int8_rules(
    act: QuantSpec,
    weight: QuantSpec,
    share_recurrent_state: bool = False,
    split_stacked: bool = True,
    table: Callable[[fx.Node], QuantSpec] | None = None,
    sequence: QuantSpec | None = None,
) -> tuple[Rule, ...]:
    """The rules of Int8Quantizer for the given activation and weight specs (``table``: an
    embedding's table spec, ``weight`` when None; ``sequence``: whole-mode recurrent layers'
    input and output sequences', ``act`` when None)."""
    fused_activations = RELU_OPS
    split_kinds = SPLITTABLE if split_stacked else RELU_ONLY

    def weighted(node: fx.Node) -> Annotation:
        """linear / conv: the output is left to a following relu it fuses with."""
        fused = _sole_user_is(node, fused_activations)
        return weighted_annotation(node, act, weight, None if fused else clamped_spec(node, act))

    def transposed(node: fx.Node) -> Annotation | None:
        """conv_transpose1d/2d (or ``aten.convolution(transposed=True)``): as conv, the
        weight per channel along its axis 1."""
        if node.target is aten.convolution.default and not is_transposed_convolution(node):
            return None
        fused = _sole_user_is(node, fused_activations)
        return transposed_annotation(node, act, weight, None if fused else clamped_spec(node, act))

    def relu(node: fx.Node) -> Annotation:
        producer = node.args[0]
        fused = isinstance(producer, fx.Node) and (
            getattr(producer.target, "overloadpacket", None)
            in (aten.linear, aten.conv1d, aten.conv2d, *TRANSPOSED_CONVS, *NORM_OPS)
            or is_transposed_convolution(producer)
        )
        return Annotation(outputs=act, inputs={} if fused else {(0,): clamped_spec(producer, act)})

    def norm(node: fx.Node) -> Annotation:
        """The input, and the output unless a relu it fuses with follows."""
        fused = _sole_user_is(node, fused_activations)
        return Annotation(outputs=None if fused else clamped_spec(node, act), inputs={(0,): act})

    def binary(node: fx.Node) -> Annotation | None:
        if node.target in BINARY_OPS and _masked_with_infinity(node):
            return Annotation()  # a mask holding -inf added to scores: float, as the softmax
        inputs = {(i,): act for i, a in enumerate(node.args[:2]) if _is_float_node(a)}
        return Annotation(outputs=clamped_spec(node, act), inputs=inputs) if inputs else None

    def fixed_output(spec: FixedSpec) -> Callable[[fx.Node], Annotation]:
        return lambda node: Annotation(outputs=spec, inputs={(0,): act})

    def same_as_input(node: fx.Node) -> Annotation:
        """Every float output leaf carries exactly the input's parameters; an input that
        only reshapes a tensor the recipe quantizes (``unsqueeze`` before a 2-d max pool)
        is read on that tensor's grid, where its values already are."""
        input_use = Use.of(node, (0,))
        outputs = _shaped_like(node, SharedSpec(input_use))
        source = _reshaped_from(node.args[0])
        if source is not None and _has_own_grid(source):
            return Annotation(outputs=outputs, inputs={(0,): SharedSpec(Value(source))})
        return Annotation(outputs=outputs, inputs={(0,): clamped_spec(node.args[0], act)})

    def _has_own_grid(producer: fx.Node) -> bool:
        """Whether the rules above give ``producer``'s output a grid of its own."""
        packet = getattr(producer.target, "overloadpacket", None)
        if packet in (aten.linear, aten.conv1d, aten.conv2d, *NORM_OPS):
            return not _sole_user_is(producer, fused_activations)
        if packet in BINARY_OPS and _masked_with_infinity(producer):
            return False
        return packet in (*BINARY_OPS, *UNARY_OPS) and _is_float_node(producer.args[0])

    def cat(node: fx.Node) -> Annotation:
        tensors = node.args[0]
        assert isinstance(tensors, list | tuple)
        inputs = {(0, i): SharedSpec(Value(node)) for i in range(len(tensors))}
        return Annotation(outputs=act, inputs=inputs)

    def unary(node: fx.Node) -> Annotation:
        """Input and output quantized separately (the op changes the range)."""
        return Annotation(outputs=clamped_spec(node, act), inputs={(0,): act})

    def softmax(node: fx.Node) -> Annotation:
        """Input and output, except an input masked with an infinite fill (attention masks):
        no grid holds -inf, so the softmax reads it in float."""
        if _masked_with_infinity(node.args[0]):
            return Annotation(outputs=act)
        return unary(node)

    def input_only(node: fx.Node) -> Annotation:
        """The input on the int8 grid, the output left float (log-probabilities keep their
        precision; an int8 grid over [-30, 0] would round them to 0.12); an input masked
        with an infinite fill stays float, as softmax's."""
        if _masked_with_infinity(node.args[0]):
            return Annotation()
        return Annotation(inputs={(0,): act})

    def embedding(node: fx.Node) -> Annotation:
        return Annotation(outputs=None, inputs={(0,): table(node) if table else weight})

    def recurrent(node: fx.Node) -> Annotation:
        if splittable(node, split_kinds):  # a stacked call: its inner layers observed too
            return Annotation(decompose=split_layers)
        return recurrent_whole_annotation(node, act, weight, share_recurrent_state, sequence)

    return (
        Rule((aten.linear, aten.conv1d, aten.conv2d), weighted),
        Rule((*TRANSPOSED_CONVS, aten.convolution), transposed),
        Rule(fused_activations, relu),
        Rule((aten.matmul, aten.bmm, aten.mm), binary),
        Rule(BINARY_OPS, binary),
        Rule((aten.sigmoid,), fixed_output(fixed_sigmoid(act.dtype))),
        Rule((aten.tanh,), fixed_output(fixed_tanh(act.dtype))),
        Rule(SAME_AS_INPUT_OPS, same_as_input),
        Rule(CAT_OPS, cat),
        Rule(UNARY_OPS, unary),
        Rule(NORM_OPS, norm),
        Rule(SUM_OPS, lambda node: unary(node) if _is_float_node(node.args[0]) else None),
        Rule((aten.softmax, aten._softmax), softmax),
        Rule((aten.log_softmax, aten._log_softmax), input_only),
        Rule((aten.embedding,), embedding),
        Rule(RECURRENT_OPS, recurrent),
        Rule(CELL_OPS, lambda node: recurrent_cell_annotation(node, act, weight)),
        pad_rule(act),
    )


CLAMPS = (aten.relu, aten.relu_, aten.relu6, aten.hardtanh, aten.hardtanh_, aten.clamp)
"""Ops that keep only an interval of their input."""
CLAMPED_PRODUCERS = (
    *(aten.linear, aten.conv1d, aten.conv2d, *TRANSPOSED_CONVS, aten.convolution),
    *(aten.matmul, aten.bmm, aten.mm, *BINARY_OPS, *UNARY_OPS, *NORM_OPS),
)
"""Ops whose output the recipe gives a grid of its own (``act``): where every reader clamps
it, that grid covers what the readers keep (``clamped_spec``)."""


def _bound(arg: object, default: float) -> float | None:
    if arg is None:
        return default
    return float(arg) if isinstance(arg, int | float) else None


def kept_interval(reader: fx.Node) -> tuple[float, float] | None:
    """The interval ``reader`` clamps its input to, or None when it does not clamp."""
    packet = getattr(reader.target, "overloadpacket", None)
    if packet not in CLAMPS:
        return None
    if packet in RELU_OPS:
        return 0.0, math.inf
    if packet is aten.relu6:
        return 0.0, 6.0
    low, high = (-1.0, 1.0) if packet in (aten.hardtanh, aten.hardtanh_) else (-math.inf, math.inf)
    args = [*reader.args[1:3], None, None][:2]
    if packet is aten.clamp:
        args = [reader.kwargs.get("min", args[0]), reader.kwargs.get("max", args[1])]
    else:
        args = [reader.kwargs.get("min_val", args[0]), reader.kwargs.get("max_val", args[1])]
    lo, hi = _bound(args[0], low), _bound(args[1], high)
    return None if lo is None or hi is None else (lo, hi)


def clamped_spec(producer: object, act: QuantSpec) -> QuantSpec:
    """``act`` for the output of ``producer``, calibrated on what its readers keep when every
    one of them clamps it (a ReLU6 after a convolution, a ReLU after a residual add): the
    readers discard the rest, so a grid covering it only coarsens the values they keep. The
    clamp's input spec asks the same, so the producer's grid and the clamp's are one; the
    graph, and so the lowered kernels, do not change."""
    if (
        not isinstance(producer, fx.Node)
        or not {producer.target, getattr(producer.target, "overloadpacket", None)}
        & set(CLAMPED_PRODUCERS)
        or act.axis is not None
        or not producer.users
    ):
        return act
    kept = [kept_interval(reader) for reader in producer.users]
    if any(k is None for k in kept):
        return act
    lows, highs = zip(*(k for k in kept if k is not None), strict=True)
    return dataclasses.replace(act, clamped=(min(min(lows), 0.0), max(max(highs), 0.0)))


RESHAPES = (
    *(aten.unsqueeze, aten.squeeze, aten.view, aten.reshape, aten._unsafe_view),
    *(aten.flatten, aten.unflatten, aten.permute, aten.transpose, aten.contiguous),
)
"""Ops that move a tensor's values without changing one: they keep the grid they are on."""


def _reshaped_from(arg: object) -> fx.Node | None:
    """The tensor ``arg`` reshapes, through any chain of ``RESHAPES`` (None when ``arg`` is
    not a reshape, or the chain starts at a tuple leaf)."""
    if not isinstance(arg, fx.Node) or getattr(arg.target, "overloadpacket", None) not in RESHAPES:
        return None
    while getattr(arg.target, "overloadpacket", None) in RESHAPES:
        source = arg.args[0]
        if not isinstance(source, fx.Node) or not is_float_tensor(tensor_meta(source)):
            return None
        arg = source
    return arg


def _shaped_like(node: fx.Node, spec: object) -> object:
    """A pytree like ``node``'s output: ``spec`` on float leaves, None on the others."""
    return tree_map(lambda leaf: spec if is_float_tensor(leaf) else None, tensor_meta(node))
