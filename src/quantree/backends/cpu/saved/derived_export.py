"""An exported program's derived constants written as the recipes that give them.

Lowering records on a constant tensor the op that derives it from tensors every call site
shares (``derived.py``). Rewriting here, on the exported program, rather than on the lowered
graph before export, reaches every constant the program reads, wherever the lowered model
keeps it: the top graph's buffers, a native cell loop's constants inside a submodule, a
region program's constant list. Each such input placeholder becomes the recipe's call; the
recipe's tensor arguments become constants of the program, read once per content (an input
equal to a tensor the program already holds reads that one), and a tensor argument that has
a recipe of its own is derived in turn. A constant with no recipe, and a recipe's tensor
argument with none (a layer's weight scales), may still be saved narrower or as one filled
value (``narrowed.py``). ``load`` folds the calls back (``fold_recipes``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from quantree.backends.cpu.saved.derived import Recipe, recipe_of
from quantree.backends.cpu.saved.narrowed import narrowed

_HELD = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _content_key(t: Tensor) -> tuple:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).digest()
    return (t.dtype, tuple(t.shape), digest)


def _held(program: torch.export.ExportedProgram, spec: InputSpec) -> Tensor | None:
    """The tensor an input spec of ``program`` reads (None for user inputs and objects)."""
    if spec.kind not in _HELD or spec.target is None:
        return None
    value = program.state_dict.get(spec.target, program.constants.get(spec.target))
    return value if isinstance(value, Tensor) else None


def _recipe(program: torch.export.ExportedProgram, spec: InputSpec) -> Recipe | None:
    """How the file gives what ``spec`` reads: the recipe lowering recorded on it, else the
    tensor in a narrower type (``narrowed.py``), else None (stored as it is)."""
    held = _held(program, spec)
    return None if held is None else recipe_of(held) or narrowed(held)


RECIPE_CALL_BYTES = 96
"""What one recipe call is taken to add to the deflated graph description (its node and its
result's tensor description): about a quarter of this on graphs whose calls repeat and
deflate well (benchmarks/README.md, "Figures moved from docstrings"), so this leaves a margin
for graphs whose calls do not."""


class _Keys:
    """Content keys of tensors, each hashed once."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple] = {}
        self._alive: list[Tensor] = []  # so an id is not reused while the key is cached

    def __call__(self, t: Tensor) -> tuple:
        if id(t) not in self._keys:
            self._keys[id(t)] = _content_key(t)
            self._alive.append(t)
        return self._keys[id(t)]


_NARROW_OPS = (
    torch.ops.quantree.widened.default,
    torch.ops.quantree.filled.default,
    torch.ops.quantree.nibbles.default,
    torch.ops.quantree.grouped_nibbles.default,
)


class _Given:
    """How the file gives each tensor a recipe reads: its own recipe, else narrowed (a
    weight scale read by a layer's offset and scale recipes), else None (stored as it is);
    each worked out once."""

    def __init__(self) -> None:
        self._given: dict[int, Recipe | None] = {}
        self._alive: list[Tensor] = []

    def __call__(self, t: Tensor, reader: Recipe) -> Recipe | None:
        if reader.op in _NARROW_OPS:  # what a narrowed constant is saved as stays as it is
            return None
        if id(t) not in self._given:
            self._given[id(t)] = recipe_of(t) or narrowed(t)
            self._alive.append(t)
        return self._given[id(t)]


def _tree(recipe: Recipe, given: _Given, key: _Keys) -> tuple[list[Tensor], list[tuple]]:
    """The tensors a recipe's call reads from the file (its arguments', recipes expanded as
    ``as_recipes`` expands them) and the nested calls it makes, each named by the tensor it
    gives (``as_recipes`` makes one call for all the recipes that read that tensor)."""
    leaves: list[Tensor] = []
    nested: list[tuple] = []
    for arg in recipe.args:
        inner = given(arg, recipe) if isinstance(arg, Tensor) else arg
        if isinstance(inner, Recipe):
            more, calls = _tree(inner, given, key)
            leaves += more
            nested += [("call", key(arg)) if isinstance(arg, Tensor) else ("call", id(arg))]
            nested += calls
        elif isinstance(arg, Tensor):
            leaves.append(arg)
    return leaves, nested


def _paying(
    program: torch.export.ExportedProgram,
    derived: list[tuple[InputSpec, Recipe]],
    key: _Keys,
    given: _Given,
) -> list[tuple[InputSpec, Recipe]]:
    """The recipes that make the file smaller. A layer called once has one offset and one
    scale: deriving them needs its float bias and weight scales, as many bytes as the two
    constants, plus the calls. Recipes are dropped one at a time (the constant is stored as
    it is) while one costs at least what it saves: the tensors only it reads, that the
    program does not hold anyway, plus its calls (a nested call other recipes make too
    counts for none of them) against the constant's own bytes."""
    chosen = {id(spec) for spec, _ in derived}
    held: set[tuple] = set()
    for spec in program.graph_signature.input_specs:
        t = _held(program, spec)
        if t is not None and id(spec) not in chosen:
            held.add(key(t))
    kept = list(derived)
    trees = {id(spec): _tree(recipe, given, key) for spec, recipe in kept}
    while True:
        readers: dict[tuple, int] = {}
        for spec, _ in kept:
            leaves, nested = trees[id(spec)]
            for k in {key(t) for t in leaves} | set(nested):
                readers[k] = readers.get(k, 0) + 1
        for i, (spec, recipe) in enumerate(kept):
            leaves, nested = trees[id(spec)]
            alone = {key(t): t.nbytes for t in leaves if key(t) not in held}
            calls = 1 + sum(readers[k] == 1 for k in set(nested))
            cost = sum(n for k, n in alone.items() if readers[k] == 1) + calls * RECIPE_CALL_BYTES
            value = _held(program, spec)
            if recipe.op not in _NARROW_OPS and value is not None and value.nbytes <= cost:
                held.add(key(value))
                del kept[i]
                break
        else:
            return kept


def as_recipes(program: torch.export.ExportedProgram) -> int:
    """Replace each input of ``program`` that has a recipe by the recipe's call (in place:
    ``program`` is the one ``save`` made). Returns how many."""
    graph = program.graph_module.graph
    specs = program.graph_signature.input_specs
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    derived = [(spec, recipe) for spec in specs if (recipe := _recipe(program, spec)) is not None]
    key = _Keys()
    given = _Given()
    derived = _paying(program, derived, key, given)
    if not derived:
        return 0
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders.values()])
    assert fake_mode is not None, "an exported program's placeholders carry fake values"
    replaced = {id(spec) for spec, _ in derived}
    by_content: dict[tuple, fx.Node] = {}
    for spec in specs:
        held = _held(program, spec)
        if held is not None and id(spec) not in replaced and spec.arg.name in placeholders:
            by_content.setdefault(key(held), placeholders[spec.arg.name])
    body = next(n for n in graph.nodes if n.op != "placeholder")

    def read(t: Tensor) -> fx.Node:
        k = key(t)
        if k not in by_content:
            target = f"_derived_from_{len(program.constants)}"
            while target in program.constants or target in program.state_dict:
                target += "_"
            program.constants[target] = t.detach().contiguous()
            users = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
            first = placeholders.get(specs[users[0]].arg.name) if users else None
            with graph.inserting_before(first or body):
                node = graph.placeholder(target)
            node.meta["val"] = fake_mode.from_tensor(t, static_shapes=True)
            spec = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), target)
            specs.insert(users[0] if users else len(specs), spec)
            by_content[k] = node
        return by_content[k]

    calls: dict[tuple, fx.Node] = {}  # one call per op and arguments (a layer's row sums)

    def call(recipe: Recipe, val: Any = None) -> fx.Node:
        args: list[Any] = []
        for arg in recipe.args:
            if isinstance(arg, Tensor) and given(arg, recipe) is not None:
                arg = given(arg, recipe)
            if isinstance(arg, Recipe):
                args.append(call(arg))
            elif isinstance(arg, Tensor):
                args.append(read(arg))
            else:
                args.append(arg)
        same = (recipe.op, *(a if isinstance(a, fx.Node) else (type(a), repr(a)) for a in args))
        if same not in calls:
            with graph.inserting_before(body):
                node = graph.call_function(recipe.op, tuple(args))
            if val is None:  # a nested recipe: its result's fake, made from the real one
                val = fake_mode.from_tensor(recipe.compute(), static_shapes=True)
            node.meta["val"] = val
            calls[same] = node
        return calls[same]

    for spec, recipe in derived:
        old = placeholders[spec.arg.name]
        old.replace_all_uses_with(call(recipe, old.meta.get("val")))
        graph.erase_node(old)
        specs.remove(spec)
    targets = {s.target for s in specs}
    for spec, _ in derived:
        if spec.target not in targets:
            program.state_dict.pop(spec.target, None)  # type: ignore[arg-type]
            program.constants.pop(spec.target, None)  # type: ignore[arg-type]
    program.graph_module.recompile()
    return len(derived)
