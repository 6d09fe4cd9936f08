"""archive_bounds: what a ``.pt2``'s members make torch allocate, bounded before it does.

A member's header declares its inflated size and torch's zip reader allocates that much
before inflating; a tensor's metadata declares sizes, strides and an offset into its record,
and torch builds the tensor over the record's bytes. Both are the file's word. Here each
deflated member is inflated once as a stream (stopping at its declared size, which must be
within the load budget, its checksum verified), the example inputs'
inner archive must store its members as they are (no bomb inside the member), and every
tensor's extent must lie inside its record.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

from quantree.backends.cpu.saved.checks.load_budget import JSON_PARSED_FACTOR, LoadBudget

CHUNK = 1 << 20


def member_sizes(
    path: Path, budget: LoadBudget | None, refuse: Callable[[str, str], Exception]
) -> dict[str, int]:
    """Each member's stored size by name (without the archive's root folder), after
    streaming every member once: a deflated one at most its declared size, within the
    budget; each of the size and checksum it declares (torch's reader checks neither for a
    stored member, so damaged tensor bytes would load as another model)."""
    sizes: dict[str, int] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            sizes[name] = info.file_size
            if budget is not None and info.compress_type != zipfile.ZIP_STORED:
                budget.charge(info.file_size * JSON_PARSED_FACTOR, f"member {name}, parsed")
            seen = 0
            try:
                with archive.open(info) as stream:
                    while chunk := stream.read(CHUNK):
                        seen += len(chunk)
            except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError,
                    NotImplementedError, RuntimeError) as error:  # fmt: skip
                raise refuse(info.filename, f"damaged data ({error})") from None
            if seen != info.file_size:
                raise refuse(info.filename, f"{seen} bytes inflated, {info.file_size} declared")
    return sizes


def inner_archive_error(data: bytes) -> str | None:
    """Why the example inputs' own zip (``torch.save``'s format) could make torch allocate
    more than its bytes: a compressed inner member, or sizes past the member's."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as inner:
            infos = inner.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None  # torch's own reader refuses it
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return "a compressed member inside the example inputs"
    if sum(i.file_size for i in infos) > len(data):
        return "example inputs larger than their member"
    return None


def _ints(values: Any) -> list[int] | None:
    if not isinstance(values, list):
        return None
    out = []
    for v in values:
        n = v.get("as_int") if isinstance(v, dict) else None
        if type(n) is not int:
            return None
        out.append(n)
    return out


def tensor_meta_error(meta: Any, record_bytes: int | None) -> str | None:
    """Why a payload config's tensor metadata does not describe a tensor inside its record
    of ``record_bytes`` bytes (None: it does)."""
    if record_bytes is None:
        return "its record is missing"
    if meta is None:
        return None  # not a tensor: the config checks use_pickle
    if not isinstance(meta, dict):
        return "tensor metadata is not a record"
    dtype = _SERIALIZE_TO_TORCH_DTYPE.get(meta.get("dtype"))  # type: ignore[call-overload]
    sizes, strides = _ints(meta.get("sizes")), _ints(meta.get("strides"))
    offset = _ints([meta.get("storage_offset")])
    if dtype is None or sizes is None or strides is None or offset is None:
        return "tensor metadata without a dtype, integer sizes, strides and offset"
    if len(sizes) != len(strides) or min([*sizes, *strides, offset[0], 0]) < 0:
        return f"sizes {sizes} and strides {strides} do not describe a tensor"
    if math.prod(sizes) == 0:
        return None
    dims = sorted((s, n) for n, s in zip(sizes, strides, strict=True) if n > 1)
    expected = 1
    for stride, n in dims:  # non-overlapping and dense: what save writes for a real tensor
        if stride != expected:
            return f"a tensor of sizes {sizes} and strides {strides} (overlapping or gapped)"
        expected *= n
    span = offset[0] + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) + 1
    needed = span * dtype.itemsize
    if needed > record_bytes:
        return f"a tensor reaching byte {needed} of a record of {record_bytes}"
    return None
