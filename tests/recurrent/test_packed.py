"""Packed sequences: pack_padded_sequence -> LSTM/GRU/RNN -> pad_packed_sequence.

torch.export cannot trace packing (data-dependent sizes); ``qt.capture`` traces it through
capture-time ops and hands back ``aten._pack_padded_sequence`` / ``aten.*.data`` /
``aten._pad_packed_sequence``. Quantized models must reach 25 dB SQNR against float on
held-out batches of other lengths (random weights; the padded layers reach 30-45 dB here),
and the CPU backend must stay within 1 dB of the reference graph's accuracy.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_leaves

import quantree as qt
from quantree.backends import CPU

from support import SortedPacked

SQNR_DB = 25.0
BATCH, STEPS, FEATURES, HIDDEN = 5, 7, 6, 12


class Packed(nn.Module):
    """What torchaudio's Tacotron2 encoder does around its LSTM."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, lengths: torch.Tensor):
        first = self.rnn.batch_first
        packed = pack_padded_sequence(x, lengths, batch_first=first, enforce_sorted=False)
        out, state = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=first, total_length=x.shape[int(first)])
        return out, state


def _batch(generator: torch.Generator, batch_first: bool):
    shape = (BATCH, STEPS, FEATURES) if batch_first else (STEPS, BATCH, FEATURES)
    lengths = torch.randint(1, STEPS + 1, (BATCH,), generator=generator)
    lengths[int(torch.randint(0, BATCH, (1,), generator=generator))] = STEPS
    return torch.randn(shape, generator=generator), lengths


CASES = {
    "lstm-bf-bidir-2layers": lambda: nn.LSTM(
        FEATURES, HIDDEN, 2, batch_first=True, bidirectional=True
    ),
    "lstm-tf": lambda: nn.LSTM(FEATURES, HIDDEN),
    "gru-tf-bidir": lambda: nn.GRU(FEATURES, HIDDEN, bidirectional=True),
    "gru-bf": lambda: nn.GRU(FEATURES, HIDDEN, batch_first=True),
    "rnn-bf-bidir": lambda: nn.RNN(FEATURES, HIDDEN, batch_first=True, bidirectional=True),
}


def _sqnr(model, other, batches) -> float:
    """The worst output leaf's SQNR over all ``batches`` together (a batch of short
    sequences alone has tiny final states; its few values are not a measurement)."""
    leaves = [(tree_leaves(model(*b)), tree_leaves(other(*b))) for b in batches]
    return min(
        float(
            qt.sqnr(
                torch.cat([e[i].flatten() for e, _ in leaves]),
                torch.cat([o[i].flatten() for _, o in leaves]),
            )
        )
        for i in range(len(leaves[0][0]))
    )


@pytest.mark.parametrize("mode", list(qt.RecurrentMode), ids=lambda m: m.value)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_quantizes_in_both_modes_and_lowers(case: str, mode: qt.RecurrentMode) -> None:
    torch.manual_seed(0)
    model = Packed(CASES[case]()).eval()
    generator = torch.Generator().manual_seed(1)
    first = model.rnn.batch_first
    calibration = [_batch(generator, first) for _ in range(12)]
    held_out = [_batch(generator, first) for _ in range(4)]
    gm = qt.capture(model, calibration[0])
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten._pack_padded_sequence.default in targets
    assert torch.ops.aten._pad_packed_sequence.default in targets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        prepared = qt.prepare(gm, qt.Int8Quantizer(recurrent=mode))
        observed = copy.deepcopy(prepared)  # held-out batches must not reach the observers
        for args in held_out:  # other lengths than the captured ones
            expected, got = model(*args), observed(*args)
            for e, g in zip(tree_leaves(expected), tree_leaves(got), strict=True):
                if mode is qt.RecurrentMode.WHOLE:  # the same aten call: bit-equal
                    assert torch.equal(e, g)
                else:  # cells: another summation order (docs/recurrent.md), so to 1e-5
                    torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
        qt.calibrate(prepared, calibration, progress=False)
        reference = qt.convert(prepared)
        lowered = qt.lower(reference, CPU)
    native = {str(n.target) for n in lowered.graph.nodes} | {
        type(m).__name__ for m in lowered.modules()
    }
    assert "quantree.rnn_packed_sequence.default" in native or "NativeCellLoop" in native
    ref_db, cpu_db = _sqnr(model, reference, held_out), _sqnr(model, lowered, held_out)
    assert ref_db >= SQNR_DB, f"reference {ref_db:.1f} dB"
    assert cpu_db >= ref_db - 1.0, f"CPU {cpu_db:.1f} dB against reference {ref_db:.1f} dB"


def test_packed_sequence_from_outside_the_model_names_the_module_and_the_fix() -> None:
    class TakesPacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.LSTM(FEATURES, HIDDEN)

        def forward(self, packed: PackedSequence):
            return self.encoder(packed)[0].data

    x, lengths = _batch(torch.Generator().manual_seed(0), False)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    with pytest.raises(qt.QuantreeError, match=r"encoder.*packed sequence.*pack_padded_sequence"):
        qt.capture(TakesPacked(), (packed,))


def test_capture_leaves_the_model_and_torch_as_they_were() -> None:
    model = Packed(nn.GRU(FEATURES, HIDDEN)).eval()
    qt.capture(model, _batch(torch.Generator().manual_seed(0), False))
    assert "forward" not in vars(model.rnn) and "permute_hidden" not in vars(model.rnn)
    assert "_pack_padded_sequence" not in vars(torch._VF)


@pytest.mark.parametrize("mode", list(qt.RecurrentMode), ids=lambda m: m.value)
@pytest.mark.parametrize("case", ["lstm-bf-bidir-2layers", "gru-tf-bidir"])
def test_lowered_packed_model_saves_and_loads_bit_equal(
    case: str, mode: qt.RecurrentMode, tmp_path
) -> None:
    """Saving re-exports the lowered graph, whose packed sizes depend on the lengths' values:
    the loaded model must give the lowered model's outputs exactly, on the example and on
    other lengths of the same padded shape."""
    from quantree.backends import load, save

    torch.manual_seed(0)
    model = Packed(CASES[case]()).eval()
    generator = torch.Generator().manual_seed(1)
    first = model.rnn.batch_first
    calibration = [_batch(generator, first) for _ in range(6)]
    quantizer = qt.Int8Quantizer(recurrent=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        lowered = qt.quantize(
            model, calibration[0], calibration, quantizer=quantizer, backend=CPU, progress=False
        )
    path = tmp_path / "packed.pt2"
    save(lowered, path, calibration[0])
    loaded = load(path)
    x = calibration[0][0]
    others = [(x, torch.tensor([STEPS, 1, 3, 3, 6])), (x, torch.tensor([2, 2, 2, STEPS, 5]))]
    for args in [calibration[0], *others]:
        expected, got = tree_leaves(lowered(*args)), tree_leaves(loaded(*args))
        assert len(expected) == len(got)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)


class PaddedToLongest(nn.Module):
    """Tacotron2's encoder and attention: padded to the longest length (data-dependent),
    then added to a broadcast query and passed through tanh, as its attention scores are."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEATURES, HIDDEN, batch_first=True)
        self.query = nn.Linear(FEATURES, HIDDEN)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return torch.tanh(out + self.query(x[:, :1]))


@pytest.mark.parametrize("mode", list(qt.RecurrentMode), ids=lambda m: m.value)
def test_lowered_model_padded_to_the_longest_length_saves_and_loads(
    mode: qt.RecurrentMode, tmp_path
) -> None:
    """The padded length is an unbacked size when saving: the int8 add and tanh after it
    must trace without guarding on it, and the loaded model match the lowered one."""
    from quantree.backends import load, save

    torch.manual_seed(0)
    model = PaddedToLongest().eval()
    generator = torch.Generator().manual_seed(1)
    calibration = [_batch(generator, True) for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        lowered = qt.quantize(
            model, calibration[0], calibration, quantizer=qt.Int8Quantizer(recurrent=mode),
            backend=CPU, progress=False,
        )  # fmt: skip
    targets = {str(n.target) for n in lowered.graph.nodes}
    assert any("binary" in t for t in targets) and any("lookup" in t for t in targets)
    save(lowered, tmp_path / "longest.pt2", calibration[0])
    loaded = load(tmp_path / "longest.pt2")
    x = calibration[0][0]
    for lengths in (calibration[0][1], torch.tensor([STEPS, 1, 3, 3, 6])):
        assert torch.equal(loaded(x, lengths), lowered(x, lengths))


def test_sorted_lengths_padded_to_the_input_length_capture_and_run_at_other_lengths() -> None:
    """Captured with a free length (what the shape guard's error tells a user to do):
    ``pad_packed_sequence``'s ``total_length`` check reads the (unbacked) number of steps,
    which the capture-time pack op bounds by the (symbolic) length."""
    torch.manual_seed(0)
    model = SortedPacked().eval()
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(4, 30, 8, generator=g), torch.tensor([30, 24, 17, 9])) for _ in range(4)]
    free = {"x": {1: torch.export.Dim.AUTO}, "lengths": None}
    q = qt.quantize(model, calib[0], calib, backend=CPU, dynamic_shapes=free)
    held = [(torch.randn(4, 21, 8, generator=g), torch.tensor([21, 20, 9, 4])) for _ in range(3)]
    assert _sqnr(model, q, held) >= SQNR_DB
