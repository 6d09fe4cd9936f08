"""Facts recorded about a constant tensor live on its storage, not in what ``torch.save``
pickles, and follow ``share_identical``."""

from __future__ import annotations

import io

import torch

from quantree.backends.cpu.saved.notes import carry, note, notes


def test_notes_are_kept_beside_the_tensor_not_on_it() -> None:
    t = torch.arange(4.0)
    note(t, "how", ("derived", 1))
    assert notes(t) == {"how": ("derived", 1)}
    assert notes(torch.arange(4.0)) == {}  # an equal tensor is another tensor
    assert not t.__dict__  # torch.save pickles nothing but the tensor
    buffer = io.BytesIO()
    torch.save({"t": t}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True)["t"], t)


def test_carry_gives_the_kept_tensor_what_it_lacks() -> None:
    kept, dropped = torch.zeros(3), torch.zeros(3)
    note(kept, "a", 1)
    note(dropped, "a", 2)
    note(dropped, "b", 3)
    carry(kept, dropped)
    assert notes(kept) == {"a": 1, "b": 3}


def test_notes_are_per_view_and_not_global() -> None:
    base = torch.zeros(6)
    note(base[:3], "x", 1)
    assert notes(base[:3]) == {"x": 1}
    assert notes(base[3:]) == {}
    assert notes(base) == {}
