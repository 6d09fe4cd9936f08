"""Observers choose their parameters on one intra-op thread (``observing/threads.py``): the
thread pool cost more than the small histogram ops it split."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import quantree as qt
from quantree.core.observing.search import RangeSearchObserver


def test_parameters_are_chosen_on_one_thread_and_the_setting_is_restored(monkeypatch):
    seen: list[int] = []
    choose = RangeSearchObserver.qparams

    def recording(self):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return choose(self)

    monkeypatch.setattr(RangeSearchObserver, "qparams", recording)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    data = [(torch.randn(4, 6),) for _ in range(3)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", qt.QuantreeWarning)
            two = qt.quantize(model, data[0], data, backend="reference", progress=False)
        assert torch.get_num_threads() == 2  # the caller's setting, restored
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        one = qt.quantize(model, data[0], data, backend="reference", progress=False)
    x = torch.randn(4, 6)
    assert torch.equal(two(x), one(x))  # the same parameters either way
