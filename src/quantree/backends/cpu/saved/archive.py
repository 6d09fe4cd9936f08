"""archive: decide, before torch opens it, whether a ``.pt2`` could run code when loaded.

Over 400 lines: the allowlist is one reading of one untrusted format (members, the JSON
schema, shape expressions, pickled globals), top to bottom; split, a check could be skipped
by calling the wrong half.

``torch.export.load`` unpickles with the full unpickler where it falls back (example inputs,
constants saved as pickles, legacy state files), ``exec``s input guards and ``sympify``s shape
expressions. Every member is checked here against an allowlist of what ``torch.export.save``
writes for plain tensors; the load then runs under :func:`weights_only_everywhere`. Written
by hand because torch offers no safe mode for export archives (its ``weights_only`` covers
``torch.load`` only).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import os
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from quantree.backends.cpu.saved.checks.archive_bounds import (
    inner_archive_error,
    member_sizes,
    tensor_meta_error,
)
from quantree.backends.cpu.saved.checks.bounded_text import (
    MAX_JSON_DEPTH,
    guard_bounded,
    json_depth,
    parse_json,
    shape_expression_ok,
)
from quantree.backends.cpu.saved.checks.load_budget import LoadBudget
from quantree.backends.cpu.saved.checks.vocabulary import program_json_error
from quantree.backends.cpu.saved.deflate import deflated_member
from quantree.core.errors import QuantreeError


class BadFile(QuantreeError):
    """An input or output file quantree cannot use; the message is one line."""


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters), for one-line errors."""
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= 200 else line[:197] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


NEVER_UNPICKLED = "quantree never unpickles user files"
RESAVE = "re-save the program with torch.export.save from plain tensors, or load it yourself"

# Members of a torch.export.save archive (names as torch's own zip reader lists them,
# without the archive's root folder). Everything else is refused.
_FIXED_MEMBERS = {
    "archive_format",
    "archive_version",
    "byteorder",
    ".data/version",
    ".data/serialization_id",
}
_MODEL = re.compile(r"models/(\w+)\.json")
_SAMPLE_INPUTS = re.compile(r"data/sample_inputs/(\w+)\.pt")
_WEIGHTS_CONFIG = re.compile(r"data/weights/(\w+)_weights_config\.json")
_CONSTANTS_CONFIG = re.compile(r"data/constants/(\w+)_constants_config\.json")
_RAW_WEIGHT = re.compile(r"weight_\d+")
_RAW_CONSTANT = re.compile(r"tensor_\d+")
_EXTRA = re.compile(r"extra/[^/]+")  # read as text by torch
MAX_INFLATED_JSON = 64 << 20
"""The largest a deflated JSON member may declare itself: torch inflates it whole in memory.
The largest graph descriptions quantree writes are a few megabytes (the zoo's: 0.1-0.6 MB
deflated, about tenfold inflated); the load budget bounds their sum."""
_REFUSED_PREFIXES = {
    "data/aotinductor/": "compiled AOTInductor code (a shared library torch would load)",
    "data/executorch/": "an ExecuTorch payload",
    "data/mtia/": "an MTIA payload",
    "data/constants/custom_obj_": "a pickled TorchScript object constant",
    "data/constants/opaque_obj_": "a pickled Python object constant",
}

# Symbolic shapes are stored as sympy expressions that torch parses with sympy.sympify (an
# eval; ``bounded_text`` holds them to its grammar); input guards are Python expressions
# torch exec's when the module is built: plain arithmetic on these names.
_PLAIN_STRING = re.compile(r"[A-Za-z_]\w*")
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_GUARD_CALLS = frozenset({"IsNonOverlappingAndDenseIndicator", "cast_symbool_to_symint_guardless"})
_MATH_CALLS = frozenset({"floor", "ceil", "trunc", "sqrt", "log2"})
_ARITHMETIC = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.UnaryOp,
    ast.USub,
    ast.UAdd,
    ast.Not,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Load,
)


def _constant_ok(node: ast.Constant) -> bool:
    value = node.value
    if isinstance(value, str):
        return bool(_PLAIN_STRING.fullmatch(value))
    return value is None or isinstance(value, bool | int | float)


def _guard_ok(text: str) -> bool:
    """``text`` compares input sizes: ``L['x'].size()[0] == L['y'].size()[0]`` and the like."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (*_ARITHMETIC, ast.Subscript)):
            continue
        if isinstance(node, ast.Constant):
            if not _constant_ok(node):
                return False
        elif isinstance(node, ast.Name):
            if node.id not in {"L", "math", "inf"} | _GUARD_CALLS:
                return False
        elif isinstance(node, ast.Attribute):
            on_math = isinstance(node.value, ast.Name) and node.value.id == "math"
            if node.attr not in (_MATH_CALLS if on_math else _GUARD_METHODS):
                return False
        elif isinstance(node, ast.Call):
            if node.keywords or not isinstance(node.func, ast.Attribute | ast.Name):
                return False
            if isinstance(node.func, ast.Name) and node.func.id not in _GUARD_CALLS:
                return False
        else:
            return False
    return True


def _treespec_ok(value: Any) -> bool:
    """No pytree context in ``value`` names a module for torch to import (defaultdict, Enum)."""
    if isinstance(value, str):
        if value[:1] not in "[{":
            return True
        if json_depth(value.encode()) > MAX_JSON_DEPTH:
            return False  # torch would parse it recursively
        try:
            value = json.loads(value)
        except ValueError:
            return True
    if isinstance(value, list):
        return all(_treespec_ok(item) for item in value)
    if isinstance(value, dict):
        module = value.get("default_factory_module")
        if "__enum__" in value:
            module = str(value.get("fqn", "")).partition(":")[0]
        if module is not None and module not in {"builtins", "collections"}:
            return False
        return all(_treespec_ok(item) for item in value.values())
    return True


def _refuse(path: Path, member: str, what: str) -> BadFile:
    return BadFile(f"{path}: refused, member {member} holds {what}; {NEVER_UNPICKLED} ({RESAVE})")


def _check_model_json(path: Path, member: str, data: bytes) -> None:
    try:
        program = parse_json(data)
    except ValueError as error:
        raise BadFile(f"{path}: member {member} is not valid JSON ({first_line(error)})") from None
    if not isinstance(program, dict):
        raise BadFile(f"{path}: member {member} is not a serialized ExportedProgram")
    refused = program_json_error(program)
    if refused is not None:
        raise BadFile(f"{path}: refused, {refused} (quantree loads only its own dialect)")
    for guard in program.get("guards_code") or ():
        if not (isinstance(guard, str) and guard_bounded(guard) and _guard_ok(guard)):
            raise _refuse(
                path, member, f"an input guard that is not plain shape arithmetic: {guard!r:.80}"
            )

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "expr_str" and not shape_expression_ok(item):
                    raise _refuse(
                        path, member, f"a symbolic expression torch would eval: {item!r:.80}"
                    )
                if key in ("in_spec", "out_spec") and not _treespec_ok(item):
                    raise _refuse(path, member, "a pytree spec that makes torch import a module")
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(program)


def _check_payload_config(
    path: Path, records: dict[str, int], member: str, data: bytes, raw: re.Pattern[str]
) -> None:
    folder = member.rsplit("/", 1)[0]
    try:
        config = parse_json(data)["config"]
        entries = list(config.items())
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise BadFile(
            f"{path}: member {member} is not a payload config ({first_line(error)})"
        ) from None
    for fqn, meta in entries:
        name = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            raise BadFile(f"{path}: member {member}: entry {fqn!r} has no path_name")
        where = f"{folder}/{name}"
        if meta.get("use_pickle") or not raw.fullmatch(name):
            raise _refuse(path, where, f"a pickled value for {fqn!r} (torch would unpickle it)")
        if where not in records:
            raise BadFile(f"{path}: member {member}: {where} is missing from the archive")
        wrong = tensor_meta_error(meta.get("tensor_meta"), records.get(where))
        if wrong is not None:
            raise BadFile(f"{path}: member {member}: entry {fqn!r} is {wrong}")


@contextlib.contextmanager
def no_protocol_warning() -> Iterator[None]:
    """torch warns (two lines on stderr) about a pickle protocol its restricted unpickler may
    not support; the load is refused or succeeds anyway, so the warning only adds noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        yield


def _check_sample_inputs(path: Path, member: str, data: bytes) -> None:
    """torch tries ``weights_only=True`` and falls back to full unpickling: only the first."""
    if not data:
        return
    wrong = inner_archive_error(data)
    if wrong is not None:
        raise BadFile(f"{path}: member {member} holds {wrong}")
    try:
        with no_protocol_warning():
            loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception:
        raise _refuse(
            path, member, "example inputs that do not load with torch.load(weights_only=True)"
        ) from None
    if not isinstance(loaded, tuple | dict):
        raise BadFile(f"{path}: member {member} holds a {type(loaded).__name__}, not inputs")


EXPORT_HOWTO = (
    "export it: torch.export.save(torch.export.export(model.eval(), example_args), 'model.pt2')"
)


def _pickle_globals(data: bytes) -> tuple[str, list[str]]:
    """The first container opcode of a pickle and the globals it names, without running it.

    ``pickletools.genops`` only parses opcodes: nothing is imported or called.
    """
    import pickletools

    first, names, strings = "", [], []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if not first and opcode.name in ("EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_DICT", "MARK"):
                first = opcode.name
            if opcode.name == "GLOBAL" and isinstance(arg, str):
                names.append(arg.replace(" ", "."))
                first = first or "GLOBAL"
            elif opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                strings.append(str(arg))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
                first = first or "GLOBAL"
    except Exception:  # a damaged pickle: say what we could tell
        pass
    return first, names


def is_export_archive(path: str | Path) -> bool:
    """Whether ``path`` is a zip archive holding a ``models/*.json`` (torch.export's layout)."""
    try:
        records = torch._C.PyTorchFileReader(str(path)).get_all_records()
    except Exception:
        return False
    return any(_MODEL.fullmatch(r) for r in records)


def _small_stored(path: str | Path, name: str) -> bool:
    """Member ``name`` (without the root folder) is stored uncompressed, within
    :data:`MAX_INFLATED_JSON` bytes."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = [i for i in archive.infolist() if i.filename.split("/", 1)[-1] == name]
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return bool(infos) and all(
        i.compress_type == zipfile.ZIP_STORED and i.file_size <= MAX_INFLATED_JSON for i in infos
    )


def identify(path: str | Path) -> str | None:
    """What a file that is not a torch.export program is, and how to get the right one.

    None when it looks like an export archive (or cannot be read at all). Reads the zip's
    member names and parses (never runs) a ``torch.save`` pickle's opcodes.
    """
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = set(reader.get_all_records())
    except Exception:
        return None
    if any(_MODEL.fullmatch(r) for r in records):
        return None
    if "constants.pkl" in records or any(r.startswith("code/") for r in records):
        return (
            "a TorchScript file (torch.jit.save), not a torch.export program; build the "
            f"model in Python (TorchScript cannot be exported) and {EXPORT_HOWTO}"
        )
    if "data.pkl" not in records:
        return None
    if not _small_stored(path, "data.pkl"):  # not read: torch would inflate what it declares
        return f"a torch.save file, not a torch.export program; {EXPORT_HOWTO}"
    first, names = _pickle_globals(reader.get_record("data.pkl"))
    tensor_only = all(
        n.startswith(("torch._utils.", "torch.", "collections.OrderedDict", "builtins."))
        and not n.startswith("torch.nn.")
        for n in names
    )
    if names and not tensor_only:
        return (
            f"a pickled object (torch.save of a {names[0]}), not a torch.export program, and "
            f"{NEVER_UNPICKLED}; build the model in Python and {EXPORT_HOWTO}"
        )
    if first in ("EMPTY_LIST", "EMPTY_TUPLE", "MARK"):
        return (
            "a torch.save'd list of tensors (calibration data?), not a torch.export program; "
            "the model comes first: quantree quantize MODEL.pt2 --calibration DATA.pt -o OUT.pt2"
        )
    if first == "EMPTY_DICT" or names[:1] == ["collections.OrderedDict"]:
        return (
            "a torch.save'd dict of tensors (a state_dict?), not a torch.export program; build "
            "the model, model.load_state_dict(torch.load(path, weights_only=True)), then "
            + EXPORT_HOWTO
        )
    return f"a torch.save file, not a torch.export program; {EXPORT_HOWTO}"


def _check_compression(path: Path) -> None:
    """Only JSON members and the example inputs may be deflated (``quantree.backends.save``
    deflates the graph description and the inputs' stand-ins), each to at most
    :data:`MAX_INFLATED_JSON`: a small file must not make torch inflate gigabytes. Tensor
    members stay stored, as torch writes them."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise BadFile(f"{path}: not a readable zip archive ({first_line(error)})") from None
    for info in members:
        if info.compress_type == zipfile.ZIP_STORED:
            continue
        inputs = _SAMPLE_INPUTS.fullmatch(info.filename.split("/", 1)[-1])
        deflatable = info.filename.endswith(".json") or inputs is not None
        if info.compress_type != zipfile.ZIP_DEFLATED or not deflatable:
            raise _refuse(path, info.filename, f"data compressed with method {info.compress_type}")
        if info.file_size > MAX_INFLATED_JSON:
            raise _refuse(
                path, info.filename, f"{info.file_size} bytes once inflated (a zip bomb?)"
            )


def check_archive(path: str | Path, budget: LoadBudget | None = None) -> None:
    """Raise :class:`BadFile` unless ``torch.export.load`` of ``path`` could never run code
    nor allocate past ``budget`` (a :class:`LoadBudgetExceeded` then).

    The archive is read with torch's own zip reader, so the members checked are the members
    torch loads.
    """
    p = Path(path)
    try:
        reader = torch._C.PyTorchFileReader(str(p))
        records = set(reader.get_all_records())
    except Exception as error:
        raise BadFile(
            f"{p}: not a readable torch.export program (truncated, or saved some other way): "
            f"{first_line(error)}"
        ) from None
    if not any(_MODEL.fullmatch(r) for r in records):
        what = identify(p)
        if what is not None:
            raise BadFile(f"{p}: {what}")
    _check_compression(p)
    sizes = member_sizes(p, budget, lambda member, what: _refuse(p, member, what))
    if budget is not None:
        stored = sum(n for name, n in sizes.items() if not deflated_member(name))
        budget.charge(stored, "the tensor records")
    models = set()
    for member in sorted(records):
        if member in _FIXED_MEMBERS or _EXTRA.fullmatch(member):
            continue
        if match := _MODEL.fullmatch(member):
            models.add(match.group(1))
            continue
        if (
            _SAMPLE_INPUTS.fullmatch(member)
            or _WEIGHTS_CONFIG.fullmatch(member)
            or _CONSTANTS_CONFIG.fullmatch(member)
        ):
            continue
        folder, _, name = member.rpartition("/")
        if (folder == "data/weights" and _RAW_WEIGHT.fullmatch(name)) or (
            folder == "data/constants" and _RAW_CONSTANT.fullmatch(name)
        ):
            continue
        for prefix, what in _REFUSED_PREFIXES.items():
            if member.startswith(prefix):
                raise _refuse(p, member, what)
        if member.endswith((".pt", ".pkl", ".pickle")) or "serialized_" in member:
            raise _refuse(p, member, "a pickle (an older or foreign archive layout)")
        raise _refuse(p, member, "something torch.export.save does not write")
    if not models:
        raise BadFile(f"{p}: not a torch.export program (no models/*.json member)")
    for model in sorted(models):
        needed = {
            "sample_inputs": f"data/sample_inputs/{model}.pt",
            "weights": f"data/weights/{model}_weights_config.json",
            "constants": f"data/constants/{model}_constants_config.json",
        }
        for member in needed.values():
            if member not in records:
                raise BadFile(f"{p}: member {member} is missing (saved some other way?)")
        _check_model_json(p, f"models/{model}.json", reader.get_record(f"models/{model}.json"))
        _check_sample_inputs(p, needed["sample_inputs"], reader.get_record(needed["sample_inputs"]))
        _check_payload_config(
            p, sizes, needed["weights"], reader.get_record(needed["weights"]), _RAW_WEIGHT
        )
        _check_payload_config(
            p, sizes, needed["constants"], reader.get_record(needed["constants"]), _RAW_CONSTANT
        )


_TORCH_LOGGERS = (
    "torch.export",
    "torch.export.pt2_archive._package",
    "torch._export.serde.serialize",
)


@contextlib.contextmanager
def weights_only_everywhere() -> Iterator[list[logging.LogRecord]]:
    """Force ``torch.load`` to its restricted unpickler and hold back torch's log records.

    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides even an explicit ``weights_only=False``; it is
    restored on exit. Records of the loaders above are collected instead of printed (torch
    logs a traceback for a broken archive before raising); the caller re-emits them.
    """
    records: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        records.append(record)
        return False

    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    for logger in loggers:
        logger.addFilter(hold)
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield records
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
        for logger in loggers:
            logger.removeFilter(hold)
