"""One intra-op thread while observers choose their parameters.

A range choice works on a histogram of a few thousand bins and a few thousand candidate
ranges: torch splits ``searchsorted`` and indexing of that size across its thread pool, and
waking the pool costs more than the work, far more on a loaded machine (figures:
benchmarks/README.md, "Stop 39"). The caller's setting is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
