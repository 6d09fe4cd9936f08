"""Deflate the graph description of a saved archive.

``torch.export.save`` stores every member uncompressed. Its tensors hardly compress, but the
graph description (``models/*.json`` and the payload configs) is verbose JSON in torch's own
schema, with keys we cannot shorten without breaking ``torch.export.load``: a visible share
of a small model's int8 weights, and it deflates about tenfold (the
example inputs' stand-ins too: ``deflated_member``). torch
reads its archives with miniz, which inflates deflated members, so the file stays a
``torch.export`` archive that a plain ``torch.export.load`` reads. Tensor members stay stored,
each at a 64-byte aligned offset as torch writes them (so they can still be mapped).
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from pathlib import Path

ALIGNMENT = 64
"""Where stored members' data starts, as torch's own writer aligns it."""
_PAD_ID = 0x4246  # the extra-field id torch's writer pads with ("FB")
_LOCAL_HEADER = 30


_SAMPLE_INPUTS = re.compile(r"(.*/)?data/sample_inputs/\w+\.pt")


def deflated_member(name: str) -> bool:
    """Whether quantree deflates (and ``check_archive`` accepts deflated) member ``name``:
    the JSON descriptions, and the example inputs, a ``torch.save`` zip of the inputs'
    one-element stand-ins (``compact.py``) that is mostly alignment padding (1.8 KB, 0.7 KB
    deflated: 0.5% of a 260 K-parameter model)."""
    return name.endswith(".json") or bool(_SAMPLE_INPUTS.fullmatch(name))


def _padding(offset: int, name: str) -> bytes:
    """An extra field that puts the data of a member whose header is at ``offset`` on the
    alignment (an extra field is 4 bytes at least: id and length)."""
    start = offset + _LOCAL_HEADER + len(name.encode())
    pad = (-(start + 4)) % ALIGNMENT
    return struct.pack("<HH", _PAD_ID, pad) + b"\0" * pad


def deflate_descriptions(path: str | Path) -> None:
    """Rewrite the archive at ``path`` with its JSON members deflated (atomically)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with zipfile.ZipFile(path) as source, zipfile.ZipFile(partial, "w") as target:
            for info in source.infolist():
                data = source.read(info)
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                if deflated_member(info.filename):
                    out.compress_type = zipfile.ZIP_DEFLATED
                else:
                    out.compress_type = zipfile.ZIP_STORED
                    out.extra = _padding(target.fp.tell(), info.filename)  # type: ignore[union-attr]
                target.writestr(out, data, compresslevel=9)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
