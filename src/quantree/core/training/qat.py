"""prepare_qat: the prepared graph with fake quantization that trains, and back again.

A QAT model is made from what ``prepare`` makes, so it quantizes exactly the points a
post-training model does (every leaf of a nested output, every cell of a decomposed
recurrent layer) with the same sharing groups: prepare annotates and groups, calibration
runs its observers, and then each group's observer is replaced, under the same name, by a
fake-quant module initialised from it (``fake_quant.py``). The graph is rewired the way
``convert`` rewires it: a group's fake quantization sits on every edge ``convert`` would
give that group's q/dq pair (a Value's leaf, and a Use whose group differs requantized on its
edge), so the QAT forward is the reference graph's arithmetic, in float, with gradients.

``convert`` of a QAT model first undoes the rewiring (:func:`as_prepared`): the fake-quant
modules stay where the observers were and answer ``qparams()`` with the learned parameters,
so the rest of convert, lowering, saving and export are the post-training ones unchanged.
The weights convert reads are the model's own, trained, parameters.

Batch norm: ``prepare`` folds an eval-mode batch norm into the conv or linear before it
(running statistics), so QAT trains the folded weight and bias; the running statistics stay
frozen, as they are in pt2e's QAT once ``freeze_bn_stats`` ran.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from quantree.core.calibrate import calibrate
from quantree.core.errors import QuantreeError
from quantree.core.graphs import (
    copy_graph_module,
    fetch_attr,
    nested_graphs,
    owner_of,
    replace_submodule,
)
from quantree.core.grouping.group_params import describe_unobserved, unobserved_groups
from quantree.core.grouping.sharing import Group
from quantree.core.observing.observers import Observer
from quantree.core.observing.qparams import fixed_qparams
from quantree.core.prepare import prepare
from quantree.core.quantizer import Quantizer
from quantree.core.specs import Derivation, FixedSpec, QuantSpec
from quantree.core.stages import (
    GROUPS_KEY,
    OBSERVER_KEY,
    PREPARED,
    STAGE_KEY,
    node_quant,
)
from quantree.core.training.fake_quant import (
    DerivedFakeQuant,
    FakeQuant,
    FixedFakeQuant,
    LearnedFakeQuant,
)
from quantree.core.values import Path, Value, arg_at, input_uses, value_carriers

QAT = "qat"
"""``gm.meta[STAGE_KEY]`` of a QAT model (and of each graph nested in it)."""
FAKE_QUANT_KEY = "quantree_fake_quant"
"""``node.meta`` key on a fake-quant call: the id of the group it fake-quantizes."""


STARTED_KEY = "quantree_qat_started"
"""``gm.meta`` key on a QAT model whose fake quantization has started (see :func:`start_qat`)."""


def prepare_qat(
    gm: fx.GraphModule,
    quantizer: Quantizer,
    calibration: Iterable[Any] | None = None,
    *,
    learn_scales: bool = True,
    progress: bool = False,
    stacklevel: int = 2,
) -> fx.GraphModule:
    """A trainable copy of ``gm`` with fake quantization at every point prepare observes.

    Ranges start where post-training calibration puts them. With ``calibration`` (argument
    tuples, as :func:`quantree.calibrate` takes) it runs now and the model fake-quantizes
    from its first call. Without, the model first calibrates like a prepared one: calls
    without gradients (``quantree.calibrate(qat, data)``) observe and pass float through;
    the first call with gradients (the first training step) starts fake quantization from
    what was observed, observing that call's own inputs first if nothing was. The scales
    are then ``nn.Parameter``s an optimizer over ``model.parameters()`` learns
    (``learn_scales=False``, or :func:`freeze_qat`, keeps them); the quantized weights and
    biases are trainable parameters too. ``gm`` and the model it came from are not changed.
    """
    prepared = prepare(gm, quantizer, stacklevel=stacklevel + 1)
    with warnings.catch_warnings():  # torch's own deprecation inside its pytree specs' copy
        warnings.simplefilter("ignore", FutureWarning)
        qat = copy.deepcopy(prepared)  # the prepared graph shares the user's parameters
    _to_fake_quant(qat)
    for body in nested_graphs(qat).values():
        if body.meta.get(STAGE_KEY) == PREPARED:
            _to_fake_quant(body)
    qat.recompile()
    qat.meta[STARTED_KEY] = False
    qat.register_forward_pre_hook(start_on_training, with_kwargs=True)
    freeze_qat(qat, frozen=not learn_scales)
    if calibration is not None:
        calibrate(qat, calibration, progress=progress)
        start_qat(qat)
    return qat


def is_qat(gm: nn.Module) -> bool:
    return isinstance(gm, fx.GraphModule) and gm.meta.get(STAGE_KEY) == QAT


def start_qat(qat: fx.GraphModule) -> fx.GraphModule:
    """Turn what calibration observed into the first scales and fake-quantize from now on.

    In place; done once. ``prepare_qat`` with calibration data, the first training step and
    ``convert`` call it; a point calibration never reached is an error naming it.
    """
    if qat.meta.get(STARTED_KEY):
        return qat
    for graph in [qat, *nested_graphs(qat).values()]:
        groups: dict[int, Group] | None = graph.meta.get(GROUPS_KEY)
        missing = unobserved_groups(graph, groups) if groups is not None else []
        if missing:
            raise QuantreeError(
                f"calibration never observed {describe_unobserved(graph, missing)}, so QAT has "
                "no range to start these fake quantizations from. Give prepare_qat (or "
                "quantree.calibrate, before training) calibration inputs that give these "
                "tensors data (e.g. a non-zero context or memory length, inputs that take the "
                "branch holding them)"
            )
    modules = fake_quant_modules(qat).values()
    for module in sorted(modules, key=lambda m: not isinstance(m, LearnedFakeQuant)):
        module.start()
    qat.meta[STARTED_KEY] = True
    return qat


def start_on_training(module: nn.Module, args: Any, kwargs: Any) -> None:
    """The QAT model's forward pre-hook: its first call with gradients starts it."""
    if not isinstance(module, fx.GraphModule) or module.meta.get(STARTED_KEY, True):
        return
    if not torch.is_grad_enabled():  # calibrating
        return
    learned = [m for m in fake_quant_modules(module).values() if isinstance(m, LearnedFakeQuant)]
    if not any(m.observer is not None and m.observer.calibrated for m in learned if m.axis is None):
        with torch.no_grad():  # never calibrated: this call's inputs are the calibration
            module(*args, **kwargs)
    start_qat(module)


def freeze_qat(qat: fx.GraphModule, frozen: bool = True) -> fx.GraphModule:
    """Stop (or, ``frozen=False``, resume) learning the scales of ``qat``, in place.

    Fake quantization stays on and the weights keep training: the usual last phase of QAT.
    Scales a spec fixes (``power_of_two``) and those of groups that only held zeros never
    learn.
    """
    if not is_qat(qat):
        raise QuantreeError(
            f"freeze_qat expects a model from quantree.prepare_qat, got a "
            f"{qat.meta.get(STAGE_KEY, 'float') if isinstance(qat, fx.GraphModule) else 'float'}"
            " model: prepare it with quantree.prepare_qat first"
        )
    for module in qat.modules():
        if isinstance(module, LearnedFakeQuant):
            module.freeze(frozen)
    return qat


def fake_quant_modules(qat: nn.Module) -> dict[str, FakeQuant]:
    """Every fake-quant module of a QAT model by qualified name (nested graphs included)."""
    return {name: m for name, m in qat.named_modules() if isinstance(m, FakeQuant)}


def _to_fake_quant(gm: fx.GraphModule) -> None:
    """Replace ``gm``'s observers by fake-quant modules and rewire its edges, in place."""
    groups: dict[int, Group] = gm.meta[GROUPS_KEY]
    modules: dict[int, FakeQuant] = {}
    names: dict[int, str] = {}

    def module_of(gid: int, trail: tuple[int, ...] = ()) -> FakeQuant:
        if gid in modules:
            return modules[gid]
        group = groups[gid]
        if gid in trail:
            raise QuantreeError(f"DerivedSpec cycle through {group.label}")
        made: FakeQuant
        if isinstance(group.spec, FixedSpec):
            made = FixedFakeQuant(fixed_qparams(group.spec), group.spec, group.label)
        elif isinstance(group.spec, Derivation):
            sources = [module_of(s, (*trail, gid)) for s in group.derived_from]
            made = DerivedFakeQuant(group.spec, sources, group.label)
        else:
            assert isinstance(group.spec, QuantSpec) and group.observer is not None
            observer = gm.get_submodule(group.observer)
            assert isinstance(observer, Observer)
            made = LearnedFakeQuant(observer, group.spec, group.label)
        name = group.observer or f"fake_quant_{gid}"
        if group.observer is not None:
            delattr(gm, group.observer)
        gm.add_submodule(name, made)
        modules[gid], names[gid] = made, name
        return made

    for gid in groups:
        module_of(gid)
    graph = gm.graph
    for node in list(graph.nodes):
        if OBSERVER_KEY in node.meta:
            graph.erase_node(node)

    value_group: dict[Value, int] = {}
    for node in graph.nodes:
        info = node_quant(node)
        if info is not None:
            value_group.update({Value(node, p): g for p, g in info.output_groups.items()})
    cache: dict[tuple[fx.Node, int], fx.Node] = {}

    def fake_quantized(source: fx.Node, gid: int) -> fx.Node:
        if (source, gid) not in cache:
            with graph.inserting_after(source):
                call = graph.call_module(names[gid], (source,))
            call.meta["val"] = source.meta.get("val")
            call.meta[FAKE_QUANT_KEY] = gid
            cache[(source, gid)] = call
        return cache[(source, gid)]

    for user in list(graph.nodes):
        if FAKE_QUANT_KEY in user.meta:
            continue
        info = node_quant(user)
        for use in list(input_uses(user)):
            source = arg_at(user, use.arg_path)
            vg = value_group.get(use.value)
            ug = info.input_groups.get(use.arg_path) if info is not None else None
            if vg is None and ug is None:
                continue
            new = source if vg is None else fake_quantized(source, vg)
            if ug is not None and ug != vg:
                new = fake_quantized(new, ug)
            _set_arg(user, use.arg_path, new)
    carriers = value_carriers(graph)
    for value, gid in value_group.items():  # unread (a dropped h_n): observed, as in prepare
        fake_quantized(carriers[value], gid)
    _make_trainable(gm)
    gm.meta[STAGE_KEY] = QAT
    graph.lint()
    gm.recompile()


def _make_trainable(gm: fx.GraphModule) -> None:
    """Every float constant a group quantizes (weights, biases) becomes an ``nn.Parameter``.

    Prepare may hold them as buffers (a batch norm folded into a weight, a cell body's gate
    rows); QAT trains them all, and convert quantizes whatever they hold by then.
    """
    quantized = {
        str(source.target)
        for node in gm.graph.nodes
        if FAKE_QUANT_KEY in node.meta
        for source in node.all_input_nodes
        if source.op == "get_attr"
    }
    for target in sorted(quantized):
        tensor = fetch_attr(gm, target)
        if isinstance(tensor, nn.Parameter) or not tensor.is_floating_point():
            continue
        owner, leaf = owner_of(gm, target)
        assert isinstance(owner, nn.Module)
        delattr(owner, leaf)
        owner.register_parameter(leaf, nn.Parameter(tensor.detach().clone()))


def _set_arg(user: fx.Node, path: Path, new: fx.Node) -> None:
    head, *rest = path
    if isinstance(head, str):
        user.kwargs = {**user.kwargs, head: _replaced(user.kwargs[head], tuple(rest), new)}
    else:
        user.args = _replaced(user.args, path, new)


def _replaced(obj: Any, path: Path, new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(obj, dict):
        return {**obj, head: _replaced(obj[head], tuple(rest), new)}
    items = list(obj)
    items[head] = _replaced(items[head], tuple(rest), new)  # type: ignore[index]
    return type(obj)(items) if isinstance(obj, tuple) else items


def as_prepared(qat: fx.GraphModule) -> fx.GraphModule:
    """A prepared-stage copy of a QAT model for ``convert``: fake-quant calls removed.

    The learned-group modules stay under their observers' names and answer ``qparams()``;
    the fake-quant modules of fixed and derived groups go (convert computes those
    parameters itself). ``qat`` is not changed.
    """
    start_qat(qat)
    gm = _stripped(qat)
    for name, body in nested_graphs(gm).items():
        if body.meta.get(STAGE_KEY) == QAT:
            replace_submodule(gm, name, _stripped(body))
    return gm


def _stripped(qat: fx.GraphModule) -> fx.GraphModule:
    gm = copy_graph_module(qat)
    groups: dict[int, Group] = gm.meta[GROUPS_KEY]
    keep = {g.observer for g in groups.values() if g.observer is not None}
    for node in list(gm.graph.nodes):
        if FAKE_QUANT_KEY in node.meta:
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            gm.graph.erase_node(node)
    for name, module in list(gm.named_children()):
        if isinstance(module, FakeQuant) and name not in keep:
            delattr(gm, name)
    gm.meta[STAGE_KEY] = PREPARED
    gm.graph.lint()
    gm.recompile()
    return gm
