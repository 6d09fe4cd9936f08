"""Fast checks of the bundled char-LM workload: vocabulary, data split, weights, export."""

from __future__ import annotations

import importlib.util
import math
import shlex
import time
from pathlib import Path

import pytest
import torch

from quantree.workloads import (
    UNK_ID,
    VOCAB,
    VOCAB_SIZE,
    CharLM,
    batches,
    bits_per_char,
    corpus_files,
    decode,
    encode,
    eval_batches,
    load_charlm,
    load_corpus,
    weights_path,
)


@pytest.fixture(scope="module")
def val_stream() -> torch.Tensor:
    return load_corpus("validation")


def test_vocab_round_trip() -> None:
    assert VOCAB_SIZE == 98 and UNK_ID == 97
    text = "def f(x):\n\treturn x ~ {'a': 1}  # ok\n" + VOCAB
    ids = encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < UNK_ID
    assert decode(ids) == text
    assert encode("é\r€").tolist() == [UNK_ID] * 3
    assert decode([UNK_ID]) == "\ufffd"


def test_split_is_by_file_and_disjoint() -> None:
    train, val = set(corpus_files("train")), set(corpus_files("validation"))
    assert train and val and not train & val
    assert 0.04 < len(val) / (len(train) + len(val)) < 0.2
    assert not any(p.parts[0] in {"test", "idlelib", "site-packages"} for p in train | val)
    assert corpus_files("validation") == sorted(val, key=lambda p: p.as_posix())


def test_validation_loads_fast(val_stream: torch.Tensor) -> None:
    start = time.perf_counter()
    again = load_corpus("validation")
    assert time.perf_counter() - start < 2.0
    assert torch.equal(again, val_stream) and val_stream.ndim == 1 and len(val_stream) > 100_000


def test_batches_are_seeded(val_stream: torch.Tensor) -> None:
    a = batches(val_stream, batch_size=4, seq_len=16, n_batches=3, seed=1)
    b = batches(val_stream, batch_size=4, seq_len=16, n_batches=3, seed=1)
    assert len(a) == 3 and all(len(t) == 1 and t[0].shape == (4, 16) for t in a)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    c = batches(val_stream, batch_size=4, seq_len=16, n_batches=3, seed=2)
    assert not torch.equal(a[0][0], c[0][0])


def test_eval_batches_shift_and_constant_shape(val_stream: torch.Tensor) -> None:
    pairs = eval_batches(val_stream, seq_len=16, batch_size=4, max_chars=1000)
    assert len(pairs) == (999 // 16) // 4
    for inputs, targets in pairs:
        assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(pairs[0][0][0, 1:], pairs[0][1][0, :-1])
    assert torch.equal(pairs[0][1][0, -1], pairs[0][0][1, 0])
    with pytest.raises(ValueError):
        eval_batches(val_stream, seq_len=16, batch_size=4, max_chars=10)


@pytest.mark.parametrize("rnn", ["lstm", "gru"])
def test_pretrained_bits_per_char(rnn: str, val_stream: torch.Tensor) -> None:
    assert weights_path(rnn).is_file()  # type: ignore[arg-type]
    model = load_charlm(rnn)  # type: ignore[arg-type]
    assert not model.training and isinstance(model, CharLM)
    bpc = bits_per_char(model, val_stream, max_chars=20_000)
    assert bpc < 2.1


def test_bits_per_char_accepts_tuple_output(val_stream: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = CharLM(VOCAB_SIZE, rnn="gru", hidden=32, layers=1).eval()
    plain = bits_per_char(model, val_stream, seq_len=32, batch_size=4, max_chars=2000)
    wrapped = bits_per_char(
        lambda t: (model(t),), val_stream, seq_len=32, batch_size=4, max_chars=2000
    )
    assert plain == pytest.approx(wrapped) and plain > 5.0  # untrained: near log2(98)


@pytest.mark.parametrize("rnn", ["lstm", "gru"])
def test_export(rnn: str) -> None:
    model = load_charlm(rnn)  # type: ignore[arg-type]
    tokens = encode("import os\n" * 7)[:64].view(1, 64)
    exported = torch.export.export(model, (tokens,))
    out = exported.module()(tokens)
    assert out.shape == (1, 64, VOCAB_SIZE)
    torch.testing.assert_close(out, model(tokens), rtol=1e-4, atol=1e-4)


def _training_script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "train_charlm.py"
    spec = importlib.util.spec_from_file_location("train_charlm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_is_reproducible_from_its_record() -> None:
    """Two steps, twice, give identical weights; a wall-time budget does not change them
    (the schedule follows the step count only), and the command the record gives retrains
    the same weights."""
    script = _training_script()
    stream = load_corpus("train", max_chars=20_000)
    argv = ["--rnn", "gru", "--steps", "10000", "--stop-after", "2", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--warmup", "1"]
    args = script.parse_args(argv)
    cosine = [2e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / 1e4))) for s in (1, 2)]
    assert [script.lr_at(args, s) for s in range(3)] == pytest.approx([2e-3, *cosine])
    runs = [script.train(args, stream, log=lambda _: None) for _ in range(2)]
    # a budget of 30 s: a schedule following wall time would already be at ~0.3% after a
    # step, against 0.01% of the steps
    timed = script.train(script.parse_args([*argv, "--minutes", "0.5"]), stream)
    (model, record), (again, _) = runs
    assert record["steps"] == 2 and record["stopped_by"] == "stop_after"
    command = shlex.split(str(record["reproduce"]))
    assert command[:2] == ["python", "scripts/train_charlm.py"] and "--minutes" not in command
    replayed, _ = script.train(script.parse_args(command[2:]), stream)
    init = CharLM(VOCAB_SIZE, rnn="gru").state_dict()
    for name, value in model.state_dict().items():
        assert not torch.equal(value, init[name]) or name.startswith("embedding")
        for other in (again, timed[0], replayed):
            assert torch.equal(value, other.state_dict()[name]), name
