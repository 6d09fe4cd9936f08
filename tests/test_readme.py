"""The README's quickstart runs as written.

A user's first contact is the README's quickstart; if the API drifts from it (a renamed
argument, another default backend, a save that no longer reloads bit-equal), this test fails
instead of the user. The quickstart's own asserts (the outputs' SQNR above 20 dB, the reloaded
model equal to the lowered one) are checked as it runs. It also checks the README's shape:
the two fresh-machine commands first, and at most 250 lines, the rest in docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next ``## `` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_readme_starts_with_the_two_fresh_machine_commands():
    text = README.read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    assert blocks[:2] == [
        'pip install "torch==2.13.0" -e . && quantree demo\n',
        'pip install "torch==2.13.0" -e ".[dev]" && python -m pytest\n',
    ]
    assert text.index("```bash") < text.index("## ")  # before any section


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page`` (fenced code skipped)."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for title in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file, or heading, does not exist."""
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", page.read_text()):
        path = (page.parent / target) if target else page
        if not path.exists() or (anchor and anchor not in anchors(path)):
            broken.append(f"{target}#{anchor}")
    return broken


def test_readme_is_at_most_250_lines_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "docs/" in text
    assert broken_links(README) == []


def test_docs_links_resolve():
    pages = [*(ROOT / "docs").glob("*.md"), ROOT / "benchmarks" / "README.md"]
    assert len(pages) > 5
    assert {page.name: broken_links(page) for page in pages} == {page.name: [] for page in pages}


def test_quickstart_runs(tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    blocks = python_blocks(section(README.read_text(), "Quickstart"))
    assert len(blocks) == 2, "the quickstart and the same pipeline step by step"
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": "readme_quickstart"}
    for block in blocks:  # the second block continues the first's names
        exec(compile(block, str(README), "exec"), namespace)
    assert (tmp_path / "speech.pt2").is_file()
    assert (tmp_path / "speech.onnx").is_file()
    lowered, qmodel = namespace["lowered"], namespace["qmodel"]
    x = namespace["example_args"]
    # the step-by-step block computes what the one call computes (same data, same recipe)
    assert torch.equal(lowered(*x), qmodel(*x))  # type: ignore[operator]


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class WithDecoder(torch.nn.Module):
    """A module at ``decoder.lstm``, the scope docs/recurrent.md's example names."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = Decoder()
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(x))


def test_recurrent_doc_quantizers_quantize_a_model():
    """docs/recurrent.md's quantizers, each used as the page says (40 dB measured with
    each on this model; the bound leaves room for other seeds)."""
    import quantree as qt

    blocks = python_blocks((ROOT / "docs" / "recurrent.md").read_text())
    namespace: dict[str, object] = {"qt": qt}
    exec(compile(blocks[0], "docs/recurrent.md", "exec"), namespace)
    torch.manual_seed(0)
    model = WithDecoder().eval()
    example = (torch.randn(2, 6, 8),)
    calibration = [(torch.randn(2, 6, 8),) for _ in range(3)]
    for name in ("whole", "cells", "split", "tuned"):
        quantizer = namespace[name]
        assert isinstance(quantizer, qt.Quantizer), name
        lowered = qt.quantize(
            model, example, calibration, quantizer=quantizer, backend="cpu", progress=False
        )
        assert qt.sqnr(model(*example), lowered(*example)) > 25, name
