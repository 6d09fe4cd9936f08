"""Character-level language model on the Python standard library: a real, offline workload.

Quantization error on toy random networks says little about real accuracy, and test data
cannot be downloaded. Every machine running quantree has a Python interpreter, and its
standard library is several megabytes of real text, so a small recurrent character model
trained on it gives a genuine accuracy metric (bits per character) without any network.

Everything here is deterministic: the vocabulary is fixed (not derived from the data), the
files are chosen and split by sorted path and a stable hash, and evaluation uses contiguous
windows with a constant batch shape (exported graphs may be specialized to one shape).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "UNK_ID",
    "VOCAB",
    "VOCAB_SIZE",
    "CharLM",
    "batches",
    "bits_per_char",
    "corpus_files",
    "decode",
    "encode",
    "eval_batches",
    "load_charlm",
    "load_corpus",
    "weights_path",
]

Split = Literal["train", "validation"]
RNNKind = Literal["lstm", "gru"]

# Fixed vocabulary: tab, newline, printable ASCII 32..126, then one UNK id for everything else.
VOCAB: str = "\t\n" + "".join(chr(c) for c in range(32, 127))
UNK_ID: int = len(VOCAB)
VOCAB_SIZE: int = len(VOCAB) + 1

_LUT = np.full(128, UNK_ID, dtype=np.int64)  # code point -> id, for code points < 128
for _i, _ch in enumerate(VOCAB):
    _LUT[ord(_ch)] = _i

# Path components that mark tests, IDE code, third-party or machine-specific/generated files.
_EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "site-packages",
        "dist-packages",
        "lib-dynload",
        "__pycache__",
        "encodings",
        "turtledemo",
    }
)
MAX_FILE_BYTES = 200_000
MAX_TRAIN_CHARS = 8_000_000
VALIDATION_BUCKETS = 10  # crc32(relpath) % 10 == 0 -> validation (~10% of files)
_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


def encode(text: str) -> torch.Tensor:
    """Map text to a 1-D int64 tensor of ids; characters outside the vocabulary become UNK."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(codes.shape, UNK_ID, dtype=np.int64)
    ascii_mask = codes < 128
    ids[ascii_mask] = _LUT[codes[ascii_mask]]
    return torch.from_numpy(ids)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """Inverse of :func:`encode`; UNK decodes to U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return "".join(VOCAB[i] if 0 <= i < UNK_ID else "\ufffd" for i in values)


def _is_excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in _EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    # _sysconfigdata_* differs per build; test_*.py files outside test dirs are still tests.
    return rel.name.startswith(("_sysconfigdata", "test_"))


def corpus_files(split: Split, stdlib: str | Path | None = None) -> list[Path]:
    """Sorted relative paths of the stdlib ``.py`` files in ``split``.

    The split is by file (not by character offset) so validation measures generalization to
    unseen modules; crc32 of the POSIX relative path is stable across runs and machines.
    """
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune excluded directories so site-packages is never traversed (keeps loading fast).
        dirnames[:] = [d for d in dirnames if not _is_excluded(Path(d, "x.py"))]
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root)
            if not name.endswith(".py") or _is_excluded(rel) or not path.is_file():
                continue
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            is_val = zlib.crc32(rel.as_posix().encode()) % VALIDATION_BUCKETS == 0
            if is_val == (split == "validation"):
                chosen.append(rel)
    return sorted(chosen, key=lambda p: p.as_posix())


def load_corpus(
    split: Split, stdlib: str | Path | None = None, max_chars: int | None = None
) -> torch.Tensor:
    """1-D token stream of the concatenated files of ``split`` (files joined by a newline).

    The training text is capped at ``MAX_TRAIN_CHARS`` (first files in sorted order) so that
    loading stays fast; nothing is cached on disk.
    """
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    limit = max_chars if max_chars is not None else (MAX_TRAIN_CHARS if split == "train" else None)
    pieces: list[str] = []
    total = 0
    for rel in corpus_files(split, root):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        pieces.append(text if text.endswith("\n") else text + "\n")
        total += len(pieces[-1])
        if limit is not None and total >= limit:
            break
    joined = "".join(pieces)
    return encode(joined[:limit] if limit is not None else joined)


def batches(
    stream: torch.Tensor, batch_size: int, seq_len: int, n_batches: int, seed: int = 0
) -> list[tuple[torch.Tensor]]:
    """Seeded random windows as 1-tuples ``(tokens[B, T],)``: quantree's calibration format."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len + 1, (n_batches, batch_size), generator=gen)
    offsets = torch.arange(seq_len)
    return [(stream[s[:, None] + offsets],) for s in starts]


def eval_batches(
    stream: torch.Tensor, seq_len: int = 128, batch_size: int = 32, max_chars: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Contiguous non-overlapping ``(inputs[B, T], targets[B, T])`` pairs.

    Targets are inputs shifted by one character. The last partial batch is dropped so every
    batch has the same shape.
    """
    if max_chars is not None:
        stream = stream[:max_chars]
    n_windows = (len(stream) - 1) // seq_len
    n_batches = n_windows // batch_size
    if n_batches == 0:
        raise ValueError(f"stream of {len(stream)} chars is shorter than one batch")
    used = n_batches * batch_size * seq_len
    inputs = stream[:used].view(n_batches, batch_size, seq_len)
    targets = stream[1 : used + 1].view(n_batches, batch_size, seq_len)
    return list(zip(inputs.unbind(0), targets.unbind(0), strict=True))


class CharLM(nn.Module):
    """Embedding -> 2-layer LSTM/GRU -> Linear; ``forward(tokens[B, T]) -> logits[B, T, V]``.

    The forward takes no initial state and returns only logits so that ``torch.export``
    produces a single-input, single-output graph that quantization passes can rewrite.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        rnn: RNNKind = "lstm",
        embed: int = 64,
        hidden: int = 256,
        layers: int = 2,
    ) -> None:
        super().__init__()
        if rnn not in ("lstm", "gru"):
            raise ValueError(f"rnn must be 'lstm' or 'gru', got {rnn!r}")
        self.rnn_kind: RNNKind = rnn
        self.embedding = nn.Embedding(vocab_size, embed)
        rnn_cls = nn.LSTM if rnn == "lstm" else nn.GRU
        self.rnn: nn.LSTM | nn.GRU = rnn_cls(embed, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        return self.head(out)


def _logits(output: object) -> torch.Tensor:
    # Transformed graphs sometimes return their single output wrapped in a tuple/list.
    if isinstance(output, (tuple, list)) and len(output) == 1:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"model must return logits tensor, got {type(output).__name__}")
    return output


@torch.no_grad()
def bits_per_char(
    model: Callable[[torch.Tensor], object],
    stream: torch.Tensor,
    seq_len: int = 128,
    batch_size: int = 32,
    max_chars: int | None = None,
) -> float:
    """Mean cross entropy in bits over contiguous windows (each starting from zero state).

    ``model`` is any callable mapping tokens to logits (eager module, exported or quantized
    GraphModule); the batch shape is constant because the last partial batch is dropped.
    """
    total_nats = 0.0
    count = 0
    for inputs, targets in eval_batches(stream, seq_len, batch_size, max_chars):
        logits = _logits(model(inputs)).float()
        total_nats += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    return total_nats / count / float(np.log(2.0))


def weights_path(rnn: RNNKind = "lstm") -> Path:
    """Location of the committed float32 state_dict for ``rnn``."""
    return _WEIGHTS_DIR / f"charlm_{rnn}.pt"


def load_charlm(rnn: RNNKind = "lstm") -> CharLM:
    """The pretrained model shipped with the package, in eval mode."""
    model = CharLM(VOCAB_SIZE, rnn=rnn)
    state = torch.load(weights_path(rnn), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()
