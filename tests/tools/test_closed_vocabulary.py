"""A saved program may call only quantree's dialect (``saved/checks/vocabulary.py``).

The crafted programs are real ``torch.export.save`` archives whose graph maps a file with
``aten.from_file`` and writes into it with ``aten.copy_`` (or returns its bytes): plain
``torch.export.load(...).module()`` writes the file at the first call. Every quantree entry
point refuses them at load, in one line naming the node and the op, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crafted_programs import example, with_file_ops

from quantree.tools.cli import EXIT_BAD_INPUT
from quantree.tools.files import BadFile
from quantree_cli import main


def test_plain_torch_really_writes_the_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"safe")
    torch.export.load(str(with_file_ops(tmp_path / "w.pt2", victim, b"EEEE"))).module()(*example())
    assert victim.read_bytes() == b"EEEE"


def test_a_program_writing_a_file_is_refused_everywhere(tmp_path: Path, capsys) -> None:
    from quantree.backends import load

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"safe")
    path = with_file_ops(tmp_path / "w.pt2", victim, b"EEEE")
    with pytest.raises(BadFile, match=r"node from_file\w* calls torch.ops.aten.from_file") as e:
        load(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    data = tmp_path / "data.pt"
    torch.save([example() for _ in range(2)], data)
    out = tmp_path / "out.pt2"
    quantize = ["quantize", str(path), "--calibration", str(data), "-o", str(out), "--quiet"]
    for argv in (["inspect", str(path)], quantize):
        assert main(argv) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "aten.from_file" in err, err
    assert victim.read_bytes() == b"safe" and not out.exists()


def test_a_program_reading_a_file_is_refused(tmp_path: Path) -> None:
    from quantree.backends import load

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"s")
    with pytest.raises(BadFile, match=r"aten\.from_file"):
        load(with_file_ops(tmp_path / "r.pt2", secret, None))
