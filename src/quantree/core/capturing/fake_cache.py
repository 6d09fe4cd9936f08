"""Trace with torch's fake-tensor dispatch cache off: quantree's exports run once each.

The cache keys every fake-tensor op on its arguments' metadata and, on a miss, builds the
output a second time from the entry it stores, to check the entry. That pays where one
graph is traced many times (``torch.compile``'s recompilations); an export traces each op
of the model once, mostly on sizes symbolic in that export's own shape environment (a
varying batch), so nearly every lookup misses and the cache doubles the work of each op.
The output of a fake-tensor op does not depend on the cache (torch checks that with its
``fake_tensor_cache_crosscheck_enabled``), so the exported graph is the same.

The switch is torch's own configuration, patched for the block and restored after it, so
nothing outside quantree's tracing sees it. It is read where a ``FakeTensorMode`` is made,
so the fake values a capture leaves in ``node.meta["val"]`` keep it off for the passes that
later compute with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch._dynamo.config


@contextlib.contextmanager
def fake_tensor_cache_off() -> Iterator[None]:
    """The block's new ``FakeTensorMode``s dispatch without the cache."""
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        yield
