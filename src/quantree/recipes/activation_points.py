"""Which activations the built-in recipe quantizes: every op's, or only what weights meet.

Quantizing every activation keeps int8 end to end between kernels, which is what CNNs and
recurrent models want. Transformers are different: their residual stream and layer-norm
inputs carry outliers an 8-bit grid cannot hold, and elementwise chains (GPT-2's tanh GELU,
softmax, the residual add) lose much of their accuracy when each step is rounded, for no
speed (the backend runs them in float anyway; figures in benchmarks/README.md, "Recipe
choices"). There the recipe quantizes what layers with weights
read (linear, conv, a matrix product with a constant operand, embeddings), as torchao's X86
recipe does, and leaves the rest float, products of two activations (attention) included.
Those inputs are then the only activation error left, so the recipe gives linear/conv inputs
16 bits there (``quantree.recipes.weighted_input_spec``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.fx as fx

from quantree.core.quantizer import Annotation, Rule, Target
from quantree.core.specs import QuantSpec
from quantree.core.values import is_float_tensor, tensor_meta
from quantree.recipes.transposed import (
    TRANSPOSED_CONVS,
    is_transposed_convolution,
    transposed_annotation,
)
from quantree.recipes.weighted import weighted_annotation
from quantree.recurrent.unrolled.fold import is_cell_step
from quantree.recurrent.unrolled.step_loop import StepLoop

aten = torch.ops.aten


class ActivationPoints(enum.Enum):
    """EVERY_OP: inputs and outputs of every op the recipe knows. WEIGHTED_INPUTS: only the
    inputs of linear/conv and of matrix products with a constant operand (with their weights
    and biases), embeddings and recurrent layers; a product of two activations stays float.
    AUTO: WEIGHTED_INPUTS in a graph with layer norm, group norm, a batch norm of feature
    vectors or attention, EVERY_OP elsewhere."""

    EVERY_OP = "every_op"
    WEIGHTED_INPUTS = "weighted_inputs"
    AUTO = "auto"


_NORMS = (aten.layer_norm, aten.native_layer_norm, aten.group_norm, aten.native_group_norm)
_BATCH_NORMS = (aten.batch_norm, aten._native_batch_norm_legit_no_training)
_ATTENTION = (aten.scaled_dot_product_attention,)
_SOFTMAX = (aten.softmax, aten._softmax)
_MATMULS = (aten.matmul, aten.bmm, aten.mm, aten.baddbmm)
_WEIGHTED = (aten.linear, aten.conv1d, aten.conv2d)

FLOAT_ARITHMETIC = (
    *(aten.where, aten.masked_fill, aten.masked_fill_, aten.pow, aten.div, aten.div_),
    *(aten.rsub, aten.exp, aten.sqrt, aten.rsqrt, aten.neg, aten.erf, aten.log_softmax),
    aten.scaled_dot_product_attention,
)
"""Float arithmetic of attention (masks, SDPA), norms and activations, which no recipe quantizes:
left float by design under WEIGHTED_INPUTS, so not named as ops no rule matches."""

_VERDICT_KEY = "quantree_transformer_like"


def _packet(node: fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


_ROOTS = (aten.rsqrt, aten.sqrt)
_MEANS = (aten.mean, aten.var, aten.sum)
_EPSILON_ADDS = (aten.add, aten.add_)


def _hand_written_norm(node: fx.Node) -> bool:
    """``node`` is the root of a mean of squares (or a variance), maybe plus an epsilon: the
    denominator of an RMS norm or layer norm written by hand (Mamba's, Griffin's and
    xLSTM's RMS norms, a global layer norm), ``aten.rms_norm`` itself."""
    if _packet(node) is aten.rms_norm:
        return True
    if _packet(node) not in _ROOTS:
        return False
    arg = node.args[0]
    if isinstance(arg, fx.Node) and _packet(arg) in _EPSILON_ADDS:
        tensors = [a for a in arg.args[:2] if isinstance(a, fx.Node)]
        arg = tensors[0] if len(tensors) == 1 else None
    if not isinstance(arg, fx.Node) or _packet(arg) not in _MEANS:
        return False
    squared = arg.args[0]
    return _packet(arg) is aten.var or (
        isinstance(squared, fx.Node)
        and (
            (_packet(squared) is aten.pow and squared.args[1:2] == (2,))
            or (_packet(squared) is aten.mul and squared.args[0] is squared.args[1])
        )
    )


def transformer_like(graph: fx.Graph) -> bool:
    """Whether ``graph`` normalises features (layer/group norm, a batch norm of ``[N, C]``
    features, or an RMS norm or variance written by hand) or computes attention (SDPA, or a
    softmax a matmul reads): the graphs whose residual streams carry outliers.

    The hand-written norms bring in the modern recurrences (Mamba, Griffin's RG-LRU, xLSTM,
    a dual-path RNN's global layer norm): there every op quantized rounded each step of an
    unrolled scan, its gates and log-space decays, and cost both accuracy and speed
    (benchmarks/README.md, "Modern recurrences: accuracy")."""
    owner = graph.owning_module
    if owner is not None and _VERDICT_KEY in owner.meta:
        return bool(owner.meta[_VERDICT_KEY])
    steps = _folded_steps(owner) if owner is not None else []
    verdict = any(_normalises(g) for g in (graph, *(step.graph for step in steps)))
    if owner is not None:  # asked once per node: remember the answer on the graph's module
        owner.meta[_VERDICT_KEY] = verdict
    for step in steps:
        step.meta.setdefault(_VERDICT_KEY, verdict)
    return verdict


def _normalises(graph: fx.Graph) -> bool:
    for node in graph.nodes:
        packet = _packet(node)
        if (
            packet in _NORMS
            or packet in _ATTENTION
            or (packet in _SOFTMAX and any(_packet(u) in _MATMULS for u in node.users))
            or _hand_written_norm(node)
            or _feature_batch_norm(node)
        ):
            return True
    return False


def _feature_batch_norm(node: fx.Node) -> bool:
    """An eval-mode batch norm of ``[N, C]`` feature vectors (SpeechBrain's LiGRU normalises
    its input projection so, tokens flattened into the batch): there it plays a layer norm's
    part before a recurrence, whose gates and state lost most of the model's accuracy when
    each step's ops were rounded to int8 (benchmarks/README.md, "Light-GRU's int8 step").
    An image's batch norm (3-d and up) is not counted: after a convolution it folds into its
    weights, and a CNN's graph wants every op int8 between its kernels."""
    if _packet(node) not in _BATCH_NORMS or not node.args:
        return False
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2


def _folded_steps(owner: torch.nn.Module) -> list[fx.GraphModule]:
    """The step graphs of the Python loops over time folded in ``owner``
    (``quantree.recurrent.unrolled``), cell steps aside: unrolled, their ops were the
    graph's own, so the graph and its steps are one model and take one verdict (a folded
    selective scan in a model with RMS norms keeps its arithmetic float, as unrolled). A
    recurrent cell's step keeps its own: cells mode's recipe, whatever the model around it."""
    return [
        m.body
        for m in owner.modules()
        if isinstance(m, StepLoop) and not is_cell_step(m) and isinstance(m.body, fx.GraphModule)
    ]


def weighted_inputs_rules(
    act: QuantSpec,
    weight: QuantSpec,
    points: ActivationPoints,
    float_ops: tuple[Target, ...],
    image_act: QuantSpec | None = None,
    conv1d_weight: QuantSpec | None = None,
) -> tuple[Rule, ...]:
    """Rules that, where ``points`` says so, replace the EVERY_OP annotations of the recipe:
    ``float_ops`` (the recipe's elementwise, normalisation and data-movement ops) stay float.
    ``image_act`` (default ``act``) is what a 2-d convolution reads: a wide ``act`` costs a
    convolution one kernel pass per byte of its input, where a linear's dual pass reads its
    weight once (see ``quantree.recipes.weighted_input_spec``).

    ``conv1d_weight`` (default ``weight``) is the weight spec of a 1-d convolution.

    Placed after the recipe's own rules; where they return None the recipe's rule applies.
    """
    if points is ActivationPoints.EVERY_OP:
        return ()

    def applies(node: fx.Node) -> bool:
        return points is ActivationPoints.WEIGHTED_INPUTS or transformer_like(node.graph)

    def when_applies(fn: Callable[[fx.Node], Annotation]) -> Callable[[fx.Node], Annotation | None]:
        return lambda node: fn(node) if applies(node) else None

    def weighted(node: fx.Node) -> Annotation:
        reads = image_act if image_act is not None and _packet(node) is aten.conv2d else act
        one_d = conv1d_weight is not None and _packet(node) is aten.conv1d
        wgt = conv1d_weight if one_d and conv1d_weight is not None else weight
        return weighted_annotation(node, reads, wgt, None)

    def transposed(node: fx.Node) -> Annotation | None:
        """As the convolutions: a 2-d transposed convolution reads ``image_act``, a 1-d one
        ``act`` (int16 by default: a 1-d transposed convolution is typically an audio
        decoder's last layer, where an int8 input was the model's largest error)."""
        if node.target is aten.convolution.default and not is_transposed_convolution(node):
            return None
        two_d = _packet(node) is aten.conv_transpose2d or (
            _packet(node) is aten.convolution and len(tensor_meta(node).shape) == 4
        )
        reads = image_act if image_act is not None and two_d else act
        return transposed_annotation(node, reads, weight, None)

    def matmul(node: fx.Node) -> Annotation:
        """A product with a constant operand is a layer with a weight: its inputs are
        quantized. A product of two activations (attention's ``q @ k^T`` and ``p @ v``)
        stays float, as in torchao's X86 recipe: rounding the softmax and both operands cost
        accuracy, and quantizing both operands on every call made the model slower than with
        the float product (benchmarks/README.md, "Recipe choices")."""
        operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if not any(a.op == "get_attr" for a in operands):
            return Annotation()
        inputs = {
            (i,): act
            for i, a in enumerate(node.args[:2])
            if isinstance(a, fx.Node) and is_float_tensor(tensor_meta(a))
        }
        return Annotation(inputs=inputs)

    return (
        Rule(_WEIGHTED, when_applies(weighted)),
        Rule(
            (*TRANSPOSED_CONVS, aten.convolution), lambda n: transposed(n) if applies(n) else None
        ),
        Rule((aten.matmul, aten.bmm, aten.mm), when_applies(matmul)),
        Rule((*float_ops, *FLOAT_ARITHMETIC), when_applies(lambda node: Annotation())),
    )
