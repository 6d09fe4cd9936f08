"""Grouped 4-bit weights on the channel's int8 grid (``core/observing/grouped.py``).

Every group of a weight converted with ``group_size`` is ``code * m`` (codes in [-8, 7], one
multiplier 1..16 a group); ``group_codes`` recovers exactly those; nearest rounding is the
best multiplier's per group; ``refine`` keeps the grid and lowers the output error; the
saved file packs it below 0.6x of int8 and loads it bit for bit; bad specs and sizes are
refused naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.packing import pack
from quantree.backends.cpu.saved.nibbles import pack_grouped
from quantree.core.observing.grouped import (
    GROUP_SIZE_KEY,
    best_multipliers,
    group_codes,
    quantize_grouped,
)
from quantree.core.refining.refine import REFINED_KEY


def _grouped_constants(ref: torch.fx.GraphModule) -> list[torch.Tensor]:
    return [
        getattr(ref, str(n.target))
        for n in ref.graph.nodes
        if n.op == "get_attr" and GROUP_SIZE_KEY in n.meta
    ]


def test_quantized_groups_are_codes_times_a_multiplier() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 32) * torch.tensor([0.1, 1.0, 0.3, 3.0]).repeat_interleave(8)
    scale = w.abs().amax(1) / 127.5
    q = quantize_grouped(w, scale, 8)
    found = group_codes(q, 8)
    assert found is not None
    codes, m = found
    assert codes.shape == (6, 32) and m.shape == (6, 4)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert torch.equal(codes.to(torch.int64).view(6, 4, 8) * m.to(torch.int64)[..., None],
                       q.to(torch.int64).view(6, 4, 8))  # fmt: skip
    # each group's multiplier has the least error of the 16
    groups = w.view(6, 4, 8).double()
    errors = [
        ((groups - torch.clamp(torch.round(groups / (scale.double()[:, None, None] * k)), -8, 7)
          * scale.double()[:, None, None] * k) ** 2).sum(-1)
        for k in range(1, 17)
    ]  # fmt: skip
    chosen = torch.stack(errors, -1).gather(-1, (best_multipliers(groups, scale) - 1)[..., None])
    assert torch.equal(chosen[..., 0], torch.stack(errors, -1).amin(-1))
    # small groups use small multipliers: finer steps than one scale per channel
    assert int(m[:, 0].max()) < int(m[:, 3].min())


def test_group_codes_refuses_values_no_multiplier_gives() -> None:
    assert group_codes(torch.tensor([[1, 9, 0, 0]], dtype=torch.int8), 4) is None  # 9 / 1 > 7
    assert group_codes(torch.tensor([[32, -32, 0, 0]], dtype=torch.int8), 4) is not None  # m 16
    assert group_codes(torch.tensor([[3, 0, 0]], dtype=torch.int8), 2) is None  # 3 columns


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(64, 128, batch_first=True)  # big enough for the file's bytes
        self.out = nn.Linear(128, 32)  # to be mostly weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(x)[0])


def _data() -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, 64, generator=g),) for _ in range(6)]


def _prepared(quantizer: qt.Quantizer) -> tuple[torch.nn.Module, torch.fx.GraphModule, list]:
    torch.manual_seed(0)
    model = Tagger().eval()
    with torch.no_grad():  # columns of very different magnitude: what groups are for
        model.out.weight.mul_(torch.tensor([0.05, 1.0]).repeat_interleave(64))
    data = _data()
    prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
    qt.calibrate(prepared, data, progress=False)
    return model, prepared, data


def _linear_weight(ref: torch.fx.GraphModule) -> torch.Tensor:
    """The linear's weight as the reference graph dequantizes it."""
    (linear,) = [n for n in ref.graph.nodes if n.target == torch.ops.aten.linear.default]
    dq = linear.args[1]
    ints, scale = (getattr(ref, str(a.target)) for a in dq.args[:2])
    return ints.float() * scale[:, None]


def test_grouped_reference_refine_lower_save_load(tmp_path) -> None:
    model, prepared, data = _prepared(qt.W4A8Quantizer(group_size=16))
    ref = qt.convert(prepared)
    weights = _grouped_constants(ref)
    assert len(weights) == 3  # W_ih, W_hh, the linear
    assert all(group_codes(w, 16) is not None for w in weights)
    refined = qt.refine(prepared, ref, data)
    assert all(group_codes(w, 16) is not None for w in _grouped_constants(refined))
    layers = refined.meta[REFINED_KEY]
    assert all(r.error_after <= r.error_before for r in layers if r.rounded)
    # per group beats per channel on the linear whose columns differ 20x in magnitude
    _, per_channel, _ = _prepared(qt.W4A8Quantizer())
    small = model.out.weight[:, :64]  # per channel rounds most of these to 0
    assert qt.sqnr(small, _linear_weight(ref)[:, :64]) > 15.0
    assert qt.sqnr(small, _linear_weight(qt.convert(per_channel))[:, :64]) < 5.0
    x = data[0]
    low = qt.lower(refined, CPU)
    sizes = {}
    for name, graph in (("grouped", low), ("int8", None)):
        if graph is None:
            _, p8, _ = _prepared(qt.Int8Quantizer())
            graph = qt.lower(qt.convert(p8), CPU)
        path = tmp_path / f"{name}.pt2"
        save(graph, path, x)
        sizes[name] = path.stat().st_size
        if name == "grouped":
            back = load(path)
            for args in data:
                assert torch.equal(back(*args), low(*args))
                # whole mode's kernel keeps gates and c in float: near the reference, not equal
                assert qt.sqnr(refined(*args), low(*args)) > 35.0
    assert sizes["grouped"] <= 0.6 * sizes["int8"], sizes


def test_blocked_layout_round_trips_through_grouped_nibbles() -> None:
    torch.manual_seed(0)
    w = torch.randn(20, 64)  # 20 rows: the layout pads to 32, the padding is zeros
    q = quantize_grouped(w, w.abs().amax(1) / 127.5, 32)
    blocked = pack(q)
    packed = pack_grouped(blocked)
    assert packed is not None
    codes, multipliers, group = packed
    assert group == 64 or group == 32
    back = torch.ops.quantree.grouped_nibbles(codes, multipliers, list(blocked.shape), group)
    assert torch.equal(back, blocked)
    assert codes.nbytes + multipliers.nbytes < 0.6 * blocked.nbytes


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"group_size": 1}, "group_size must be an int >= 2"),
        ({"group_size": 16, "per_channel": False}, "needs per_channel=True"),
    ],
)
def test_bad_group_options_are_refused(options, message) -> None:
    with pytest.raises(qt.QuantreeError, match=message):
        qt.W4A8Quantizer(**options)


def test_a_group_size_that_does_not_divide_names_the_fix() -> None:
    with pytest.raises(qt.QuantreeError, match="pick a group_size dividing"):
        _prepared_and_converted(qt.W4A8Quantizer(group_size=48))
    _prepared_and_converted(qt.W4A8Quantizer(group_size=64))  # the fix it names: 64 divides


def _prepared_and_converted(quantizer: qt.Quantizer) -> None:
    _, prepared, _ = _prepared(quantizer)
    qt.convert(prepared)


def test_qat_of_grouped_weights_is_refused_naming_per_channel() -> None:
    data = _data()[:2]
    model = Tagger().eval()
    with pytest.raises(qt.QuantreeError, match=r"qt.W4A8Quantizer\(\) without group_size"):
        qt.prepare_qat(qt.capture(model, data[0]), qt.W4A8Quantizer(group_size=16), data)
    qt.prepare_qat(qt.capture(model, data[0]), qt.W4A8Quantizer(), data)  # the fix it names
