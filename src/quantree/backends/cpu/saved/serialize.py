"""Saving a lowered model: ``torch.export`` around quantree's registered custom ops.

``save`` exports the lowered GraphModule with example arguments and writes a ``.pt2``
archive; ``load`` reads it back as a callable module. The archive holds the graph and the
packed int8 tensors; running it needs only torch and ``import quantree.backends`` (which
registers ``torch.ops.quantree.*``), none of quantree's passes. Constants that differ per call
site only by the call site's input grid are saved as the op deriving them from shared tensors
(``derived.py``); ``load`` computes each once. ``load`` reads through
``reader.load_program``, which refuses any archive that would make torch unpickle something
or run code (a :class:`~quantree.backends.cpu.saved.archive.BadFile`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_dense

from quantree.backends.cpu.native.chains import run_chains_natively
from quantree.backends.cpu.native.direct import call_directly
from quantree.backends.cpu.native.fast_attributes import read_buffers_directly
from quantree.backends.cpu.native.flat_inputs import bind_flat_inputs
from quantree.backends.cpu.passes.per_shape import compute_once_per_shape
from quantree.backends.cpu.saved.archive import BadFile
from quantree.backends.cpu.saved.checks.fake_check import check_on_example
from quantree.backends.cpu.saved.checks.load_budget import LoadBudget, budget_for
from quantree.backends.cpu.saved.checks.recipe_bytes import charge_recipes
from quantree.backends.cpu.saved.checks.table_needs import check_loaded_tables
from quantree.backends.cpu.saved.checks.vocabulary import program_errors
from quantree.backends.cpu.saved.compact import drop_provenance, one_name_per_tensor
from quantree.backends.cpu.saved.deflate import deflate_descriptions
from quantree.backends.cpu.saved.derived import fold_recipes
from quantree.backends.cpu.saved.derived_export import as_recipes
from quantree.backends.cpu.saved.pickling import refuse_pickling
from quantree.backends.cpu.saved.pooled import pool_small_tensors
from quantree.backends.cpu.saved.reader import (  # the one safe way to read a .pt2
    load_program,
    program_module,
)
from quantree.backends.destination import writable_destination
from quantree.core.capture import export_batch_dynamic
from quantree.core.capturing.shape_guards import explain_shape_guards
from quantree.core.errors import QuantreeError
from quantree.recurrent.packed import as_capture_ops, restore_aten


def save(
    lowered: torch.nn.Module,
    path: str | Path,
    example_args: tuple[Any, ...],
    *,
    dynamic_batch: bool = True,
) -> None:
    """Export ``lowered`` with ``example_args`` to ``path``: the first dimension of each
    input stays dynamic where the lowered graph allows it (``dynamic_batch=False``: every
    dimension fixed to the example's)."""
    writable_destination(path, "save")  # before the export's minutes, not after
    write_program(saved_program(lowered, example_args, dynamic_batch), path)


def saved_program(
    module: torch.nn.Module, example_args: tuple[Any, ...], dynamic_batch: bool = True
) -> torch.export.ExportedProgram:
    """``module`` exported as ``save`` writes it: one name per tensor, per-call-site
    constants as their recipes, no tracing provenance (``module`` itself is not changed)."""
    if isinstance(module, torch.fx.GraphModule):
        module = one_name_per_tensor(module)  # a copy that shares the tensors
        # packed sequences: exported through the ops capture traced them with, then ATen again
        as_capture_ops(module)
    program = export_batch_dynamic(module, tuple(example_args), dynamic_batch)
    restore_aten(program.graph_module)
    as_recipes(program)
    densify(program)
    pool_small_tensors(program)
    drop_provenance(program)
    refuse_unloadable(program)
    return program


def densify(program: torch.export.ExportedProgram) -> None:
    """Every weight and constant dense (a copy where one is a broadcast view, strides of 0:
    an ``expand`` folded at lowering). ``load`` reads only dense tensor records, since a file's
    overlapping strides would make views the file chooses; torch would write the view's
    strides as they are."""
    for table in (program.state_dict, program.constants):
        for name, t in list(table.items()):
            if isinstance(t, torch.Tensor) and not is_dense(t):
                table[name] = t.contiguous()


def refuse_unloadable(program: torch.export.ExportedProgram) -> None:
    """A ``QuantreeError`` before writing a file that ``load`` would refuse: a saved file may
    call only quantree's dialect (``checks/vocabulary.py``), and a model whose float part
    calls another op would otherwise be written, then refused by every ``load``."""
    refused = list(program_errors(program))
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise QuantreeError(
            f"cannot save this model: {refused[0]}{more}; load reads only ops a file can be "
            "trusted to call (quantree.backends.cpu.saved.checks.vocabulary), so the file "
            "would be refused. Write that part of the model with ops the vocabulary holds "
            "(docs/deployment.md, 'What a saved model may call') and quantize it again, or "
            "deploy the reference graph with qt.export_onnx"
        )


def write_program(program: torch.export.ExportedProgram, path: str | Path) -> None:
    """``torch.export.save``, then the graph description deflated."""
    with warnings.catch_warnings():
        # small tensors share storages on purpose (``pooled.py``); torch writes each storage
        # once, from its first to its last byte viewed, and says so
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(program, str(path))
    deflate_descriptions(path)


def load(path: str | Path, *, memory_budget: int | None = None) -> torch.nn.Module:
    """The module saved by ``save``, ready to call (its ops called without the dispatcher).

    Raises ``BadFile`` for a file that is missing, broken, would run code when loaded, calls
    an op outside quantree's dialect, or would allocate more than ``memory_budget`` bytes
    while loading (default: ``load_budget.budget_for``, from the file's size, or
    ``$QUANTREE_LOAD_BUDGET``).
    """
    budget = budget_for(path, memory_budget)
    program = load_program(path, budget)
    module = program_module(program, path, check=False)  # checked once folded, below
    if not isinstance(module, torch.fx.GraphModule):
        return module
    fold_saved_recipes(module, path, budget, program.example_inputs)
    compute_once_per_shape(module)  # a runtime form, not saved: made again here
    module = read_buffers_directly(bind_flat_inputs(call_directly(module)))
    return refuse_pickling(explain_shape_guards(run_chains_natively(module)))


def fold_saved_recipes(
    module: torch.fx.GraphModule,
    path: str | Path,
    budget: LoadBudget | None = None,
    example: Any = None,
) -> None:
    """Compute each derived constant of a loaded ``module`` once, as lowering did
    (``derived.py``), charging ``budget`` first, then check its tables and run it on fake
    tensors like ``example`` (``checks/fake_check.py``); a recipe, table or node that does not
    fit is a ``BadFile`` naming ``path``."""
    try:
        if budget is not None:
            charge_recipes(module, budget)
        fold_recipes(module)
        # program and cell-loop tables: refused here, not at a call
        check_loaded_tables(module, budget)
        check_on_example(module, example, budget.total if budget is not None else None)
    except QuantreeError as error:
        raise BadFile(f"{path}: {error}") from None
