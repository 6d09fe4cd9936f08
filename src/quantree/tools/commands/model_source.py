"""Where the command line gets a model: a saved program, or the user's own factory.

A ``.pt2`` is read with the safe loader (``tools/files.py``). A model ``torch.export`` cannot
save, or one that should be captured as ``qt.quantize`` captures it (first dimension
dynamic), is given as ``module:function`` (or ``path/to/file.py:function``): a function,
run as the user's own code, that returns ``(model, example_args)``.

A program exported without ``dynamic_shapes`` fixes every dimension, so its quantized model
takes only the example's batch size; :func:`fixed_batch_note` says so and how to avoid it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from quantree.tools.files import BadFile, first_line

FACTORY_FORM = "module:function returning (model, example_args)"


def is_factory(spec: str) -> bool:
    """``module:function`` rather than a path (a file of that name wins)."""
    module, sep, function = spec.rpartition(":")
    return bool(sep and module and function.isidentifier()) and not Path(spec).exists()


def _import(module: str, spec: str) -> Any:
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise BadFile(f"{spec}: no such file {path}")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        if loader is None or loader.loader is None:
            raise BadFile(f"{spec}: {path} cannot be imported")
        found = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(found)
        return found
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules beside the user
    return importlib.import_module(module)


def load_factory(spec: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """Call the factory ``spec`` names; its ``(model, example_args)``, checked."""
    module, _, function = spec.rpartition(":")
    try:
        found = _import(module, spec)
    except BadFile:
        raise
    except Exception as error:
        raise BadFile(
            f"{spec}: cannot import {module!r} ({type(error).__name__}: {first_line(error)}); "
            "run from the directory that holds it, put it on PYTHONPATH, or give its path "
            "as path/to/file.py:function"
        ) from None
    factory = getattr(found, function, None)
    if not callable(factory):
        raise BadFile(f"{spec}: {module!r} has no function {function!r}; expected {FACTORY_FORM}")
    try:
        made = factory()
    except Exception as error:
        raise BadFile(
            f"{spec}: the factory raised {type(error).__name__}: {first_line(error)}"
        ) from None
    if not (isinstance(made, tuple | list) and len(made) == 2):
        raise BadFile(f"{spec}: returned a {type(made).__name__}; expected {FACTORY_FORM}")
    model, example = made
    if not isinstance(model, torch.nn.Module):
        raise BadFile(
            f"{spec}: returned a {type(model).__name__} as the model; expected {FACTORY_FORM}"
        )
    if isinstance(example, torch.Tensor):
        example = (example,)
    if not isinstance(example, tuple | list):
        raise BadFile(
            f"{spec}: returned a {type(example).__name__} as the example; expected a tuple "
            "of the model's positional arguments, e.g. (x,)"
        )
    return model, tuple(example)


def fixed_batch_note(program: torch.export.ExportedProgram, source: str) -> str | None:
    """What to say when every tensor input of ``program`` has a fixed first dimension."""
    from torch.export.graph_signature import InputKind

    users = {
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind is InputKind.USER_INPUT
    }
    sizes = []
    for node in program.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" and node.name in users else None
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            if not isinstance(val.shape[0], int):
                return None  # some batch varies
            sizes.append(f"{node.name} at {val.shape[0]}")
    if not sizes:
        return None
    return (
        f"{source} was exported with every dimension fixed (batch: {', '.join(sizes)}), so "
        "the quantized model takes only that batch size. To let the batch vary, export it "
        "with dynamic_shapes (e.g. {'x': {0: torch.export.Dim.AUTO}}), or give the model as "
        "module:function so quantree captures it with a dynamic batch, as qt.quantize does"
    )
