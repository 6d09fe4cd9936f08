"""Bundled real workloads for measuring quantization accuracy offline."""

from quantree.workloads.charlm import (
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
