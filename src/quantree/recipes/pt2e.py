"""pt2e quantizers (torchao's ``Quantizer``: X86Inductor, XNNPACK, ExecuTorch's) drive prepare.

``qt.prepare(gm, X86InductorQuantizer().set_global(...))`` runs the quantizer's
``transform_for_annotation``, ``annotate`` and ``validate`` on prepare's copy of the graph,
reads the ``quantization_annotation`` each node then carries and translates it:

| pt2e | quantree |
| --- | --- |
| ``QuantizationSpec`` | ``QuantSpec`` (dtype, range, per tensor or channel, symmetric, observer) |
| ``SharedQuantizationSpec(node or (producer, user))`` | ``SharedSpec(Value or Use)`` |
| ``DerivedQuantizationSpec`` | ``DerivedSpec`` (calling its ``derive_qparams_fn``) |
| ``FixedQParamsQuantizationSpec`` | ``FixedSpec`` |
| ``input_qspec_map[node]`` | a spec on every argument path that reads that node |
| ``allow_implicit_sharing`` | ``Annotation.share_with_producers`` |

Where pt2e stops, this goes on: an ``output_qspec`` given as a list/tuple shaped like a
multi-output node's output (``aten.lstm``'s ``(out, h, c)``, ``split``) quantizes every leaf, and
so does an ``output_qspec`` on the node's ``getitem`` users. And a pt2e quantizer composes
with quantree's rules: ``qt.from_pt2e(X) + rules`` (the right side wins where both annotate,
so ``rules`` here quantizes what ``X`` leaves float, the LSTM that pt2e cannot observe).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from quantree.core.errors import QuantreeError
from quantree.core.quantizer import Annotation, Quantizer, Rule
from quantree.core.specs import (
    DerivedSpec,
    FixedSpec,
    ObserverKind,
    QDtype,
    QParams,
    QuantSpec,
    SharedSpec,
    Spec,
)
from quantree.core.values import Path, Use, Value, arg_at, input_uses, is_getitem

ANNOTATION_KEY = "quantization_annotation"
_DTYPES = {q.torch_dtype: q for q in QDtype}
_SPEC_NAMES = (
    "QuantizationSpec",
    "SharedQuantizationSpec",
    "DerivedQuantizationSpec",
    "FixedQParamsQuantizationSpec",
)


def is_pt2e_quantizer(obj: object) -> bool:
    """Whether ``obj`` is a pt2e ``Quantizer`` (torchao's, or torch.ao's where it exists)."""
    if isinstance(obj, Quantizer):
        return False
    for module in ("torchao.quantization.pt2e.quantizer", "torch.ao.quantization.quantizer"):
        try:
            base = getattr(__import__(module, fromlist=["Quantizer"]), "Quantizer", None)
        except Exception:
            continue
        if isinstance(base, type) and isinstance(obj, base):
            return True
    return all(callable(getattr(obj, m, None)) for m in ("annotate", "validate")) and callable(
        getattr(obj, "transform_for_annotation", None)
    )


class Pt2eQuantizer(Quantizer):
    """A pt2e quantizer with quantree rules around it; ``prepare`` binds it to the graph.

    ``before`` rules yield to the pt2e annotations, ``after`` rules override them.
    """

    __slots__ = ("after", "before", "pt2e")

    def __init__(self, pt2e: Any, before: Sequence[Rule] = (), after: Sequence[Rule] = ()) -> None:
        if not is_pt2e_quantizer(pt2e):
            raise QuantreeError(
                f"from_pt2e needs a pt2e Quantizer (torchao.quantization.pt2e.quantizer."
                f"Quantizer), got {type(pt2e).__name__}"
            )
        super().__init__((*before, *after))
        self.pt2e = pt2e
        self.before = tuple(before)
        self.after = tuple(after)

    def __add__(self, other: Quantizer) -> Quantizer:
        if isinstance(other, Pt2eQuantizer):
            raise QuantreeError(
                "two pt2e quantizers cannot be added; compose them first with torchao's "
                "ComposableQuantizer([a, b]) and pass that to from_pt2e"
            )
        return Pt2eQuantizer(self.pt2e, self.before, (*self.after, *other.rules))

    def __radd__(self, other: Quantizer) -> Quantizer:
        return Pt2eQuantizer(self.pt2e, (*other.rules, *self.before), self.after)

    def bind(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, Quantizer]:
        """Annotate ``gm`` with the pt2e quantizer; the graph and a rule-based quantizer."""
        name = type(self.pt2e).__name__
        try:
            result = self.pt2e.transform_for_annotation(gm)
            gm = result if isinstance(result, fx.GraphModule) else gm
            self.pt2e.annotate(gm)
            self.pt2e.validate(gm)
        except QuantreeError:
            raise
        except Exception as error:
            raise QuantreeError(
                f"the pt2e quantizer {name} failed on the graph: {error}"
            ) from error
        annotations = translate_annotations(gm)
        # a rule matches calls only: an annotated get_attr (a weight) is read by its call
        targets = tuple(dict.fromkeys(n.target for n in annotations if n.op == "call_function"))
        if not targets:
            return gm, Quantizer((*self.before, *self.after))
        rule = Rule(targets, lambda node: annotations.get(node))  # type: ignore[arg-type]
        return gm, Quantizer((*self.before, rule, *self.after))

    def __repr__(self) -> str:
        return (
            f"from_pt2e({type(self.pt2e).__name__}) with {len(self.before)} rule(s) before and "
            f"{len(self.after)} after"
        )


def from_pt2e(pt2e: Any) -> Pt2eQuantizer:
    """A quantree quantizer made of a pt2e one, composable with ``+`` with quantree rules."""
    return pt2e if isinstance(pt2e, Pt2eQuantizer) else Pt2eQuantizer(pt2e)


def as_quantizer(quantizer: Any) -> Any:
    """What ``quantree.prepare`` hands the core's ``prepare``: a pt2e quantizer wrapped (its
    ``bind`` annotates the graph with it), anything else as it is (the core checks it)."""
    return Pt2eQuantizer(quantizer) if is_pt2e_quantizer(quantizer) else quantizer


def translate_annotations(gm: fx.GraphModule) -> dict[fx.Node, Annotation]:
    """The quantree Annotation of every node a pt2e quantizer annotated in ``gm``.

    An output spec on a ``getitem`` of a multi-output node goes to that leaf of the node.
    """
    result: dict[fx.Node, Annotation] = {}
    leaf_outputs: dict[fx.Node, dict[Path, Spec | None]] = {}
    for node in gm.graph.nodes:
        pt2e = node.meta.get(ANNOTATION_KEY)
        if pt2e is None:
            continue
        if is_getitem(node):
            value = Value.of(node)
            spec = _translate(pt2e.output_qspec, node)
            if spec is not None:
                leaf_outputs.setdefault(value.node, {})[value.path] = spec
            continue
        inputs: dict[Path, Any] = {}
        for source, qspec in pt2e.input_qspec_map.items():
            paths = _paths_of(node, source)
            if not paths:
                raise QuantreeError(
                    f"node {node.name} ({node.target}): its pt2e annotation has an input spec "
                    f"for {getattr(source, 'name', source)}, which it does not read"
                )
            for path in paths:
                inputs[path] = _translate(qspec, node)
        outputs = _translate_tree(pt2e.output_qspec, node)
        result[node] = Annotation(
            outputs=outputs,
            inputs={p: s for p, s in inputs.items() if s is not None},
            share_with_producers=bool(getattr(pt2e, "allow_implicit_sharing", True)),
        )
    for root, leaves in leaf_outputs.items():
        base = result.get(root, Annotation())
        outputs = _with_leaves(root, base.outputs, leaves)
        result[root] = Annotation(
            outputs=outputs,
            inputs=base.inputs,
            share_with_producers=base.share_with_producers,
            name=base.name,
        )
    return result


def _with_leaves(root: fx.Node, outputs: Any, leaves: dict[Path, Spec | None]) -> Any:
    """``outputs`` (None or a pytree shaped like ``root``'s output) with ``leaves`` set."""
    meta = root.meta.get("val")
    if outputs is None:
        outputs = pytree.tree_map(lambda _: None, meta)

    def put(obj: Any, path: Path, spec: Any) -> Any:
        if not path:
            return spec
        head, *rest = path
        items = list(obj)
        items[head] = put(items[head], tuple(rest), spec)  # type: ignore[index]
        return type(obj)(items) if isinstance(obj, tuple) else items

    for path, spec in leaves.items():
        outputs = put(outputs, path, spec)
    return outputs


def _paths_of(node: fx.Node, source: Any) -> list[Path]:
    return [u.arg_path for u in input_uses(node) if arg_at(node, u.arg_path) is source]


def _is_spec(obj: object) -> bool:
    return type(obj).__name__ in _SPEC_NAMES


def _translate_tree(qspec: Any, node: fx.Node) -> Any:
    """A spec, or a list/tuple of them shaped like a multi-output node's output."""
    if qspec is None or _is_spec(qspec):
        return _translate(qspec, node)
    if isinstance(qspec, list | tuple):
        return tuple(_translate_tree(q, node) for q in qspec)
    raise QuantreeError(
        f"node {node.name} ({node.target}): output_qspec must be a pt2e QuantizationSpecBase "
        f"or a list/tuple of them shaped like the output, got {type(qspec).__name__}"
    )


def _translate(qspec: Any, node: fx.Node) -> Spec | None:
    if qspec is None:
        return None
    kind = type(qspec).__name__
    if getattr(qspec, "is_dynamic", False):
        raise QuantreeError(
            f"node {node.name} ({node.target}): the pt2e annotation asks for dynamic "
            "quantization, which quantree (static post-training quantization) does not do"
        )
    if kind == "SharedQuantizationSpec":
        return SharedSpec(_key(qspec.edge_or_node, node))
    if kind == "FixedQParamsQuantizationSpec":
        dtype = _dtype(qspec.dtype, node)
        return FixedSpec(
            float(qspec.scale), int(qspec.zero_point), dtype, qspec.quant_min, qspec.quant_max
        )
    if kind == "DerivedQuantizationSpec":
        dtype = _dtype(qspec.dtype, node)
        sources = tuple(_key(e, node) for e in qspec.derived_from)
        derive = functools.partial(_derive, qspec, dtype)
        return DerivedSpec(sources, derive, dtype)
    if kind == "QuantizationSpec":
        dtype = _dtype(qspec.dtype, node)
        symmetric, per_channel = _scheme(qspec.qscheme, node)
        return QuantSpec(
            dtype,
            symmetric=symmetric,
            axis=(qspec.ch_axis if qspec.ch_axis is not None else 0) if per_channel else None,
            observer=_observer_kind(qspec.observer_or_fake_quant_ctr),
            quant_min=qspec.quant_min,
            quant_max=qspec.quant_max,
        )
    raise QuantreeError(
        f"node {node.name} ({node.target}): unknown pt2e spec type {kind}; quantree reads "
        f"{', '.join(_SPEC_NAMES)}"
    )


def _key(edge_or_node: Any, node: fx.Node) -> Value | Use:
    if isinstance(edge_or_node, fx.Node):
        return Value.of(edge_or_node)
    producer, user = edge_or_node
    paths = _paths_of(user, producer)
    if not paths:
        raise QuantreeError(
            f"node {node.name} ({node.target}): its pt2e spec names the edge "
            f"{producer.name} -> {user.name}, but {user.name} does not read {producer.name}"
        )
    return Use.of(user, paths[0])


def _dtype(dtype: torch.dtype, node: fx.Node) -> QDtype:
    if dtype not in _DTYPES:
        raise QuantreeError(
            f"node {node.name} ({node.target}): the pt2e annotation asks for {dtype}; quantree "
            "quantizes to int8, uint8, int16 and int32"
        )
    return _DTYPES[dtype]


def _scheme(qscheme: Any, node: fx.Node) -> tuple[bool, bool]:
    """(symmetric, per_channel) of a torch qscheme (None: per-tensor affine)."""
    table = {
        None: (False, False),
        torch.per_tensor_affine: (False, False),
        torch.per_tensor_symmetric: (True, False),
        torch.per_channel_affine: (False, True),
        torch.per_channel_symmetric: (True, True),
    }
    if qscheme not in table:
        raise QuantreeError(
            f"node {node.name} ({node.target}): qscheme {qscheme} has no quantree equivalent "
            "(per-tensor or per-channel, affine or symmetric)"
        )
    return table[qscheme]


def _observer_kind(ctr: Any) -> ObserverKind:
    """The quantree observer kind that computes what the pt2e observer class does."""
    target = ctr
    for _ in range(4):  # with_args wrappers: _PartialWrapper(p=partial(cls, ...))
        inner = getattr(target, "p", None) or getattr(target, "func", None)
        if inner is None:
            break
        target = inner
    name = getattr(target, "__name__", type(target).__name__)
    if "Histogram" in name:
        return ObserverKind.HISTOGRAM
    if "MovingAverage" in name:
        return ObserverKind.MOVING_AVERAGE
    return ObserverKind.MINMAX


class _Observed:
    """What a pt2e ``derive_qparams_fn`` reads of an observer: its ``calculate_qparams()``."""

    def __init__(self, params: QParams) -> None:
        self.params = params
        self.dtype = params.dtype.torch_dtype
        self.quant_min, self.quant_max = params.quant_min, params.quant_max
        self.ch_axis = params.axis

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.params.scale, self.params.zero_point


def _derive(qspec: Any, dtype: QDtype, params: Sequence[QParams]) -> QParams:
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = qspec.derive_qparams_fn
    scale, zero_point = fn([_Observed(p) for p in params])
    _, per_channel = _scheme(qspec.qscheme, _NO_NODE)
    lo, hi = dtype.bounds
    qmin = lo if qspec.quant_min is None else qspec.quant_min
    qmax = hi if qspec.quant_max is None else qspec.quant_max
    scale = torch.as_tensor(scale, dtype=torch.float32)
    zero_point = torch.as_tensor(zero_point).to(torch.int64)
    if per_channel:
        axis = qspec.ch_axis if qspec.ch_axis is not None else 0
        return QParams(scale.reshape(-1), zero_point.reshape(-1), dtype, qmin, qmax, axis)
    return QParams(scale.reshape(()), zero_point.reshape(()), dtype, qmin, qmax, None)


_NO_NODE: Any = type("_Nameless", (), {"name": "(derived)", "target": "derive"})()
