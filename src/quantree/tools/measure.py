"""measure: latency and size of a model, the way the demo and the report state them."""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import attr_at


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, then restore the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def latency_ms(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    runs: int = 7,
    min_runs: int = 3,
    budget_s: float = 4.0,
) -> float:
    """Median wall time of ``fn(*args)`` in milliseconds after one warm-up call.

    Stops early (after at least ``min_runs``) once ``budget_s`` is spent, so a slow variant
    does not dominate the demo's run time.
    """
    times: list[float] = []
    with torch.no_grad():
        fn(*args)
        spent = 0.0
        for _ in range(runs):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
            spent += times[-1]
            if len(times) >= min_runs and spent > budget_s:
                break
    return statistics.median(times) * 1e3


def latencies_ms(
    models: Mapping[str, Callable[..., Any]],
    args: tuple[Any, ...],
    *,
    rounds: int = 15,
    min_runs: int = 3,
    budget_s: float = 3.0,
) -> dict[str, float]:
    """Median milliseconds per call of each model, measured round-robin.

    Models take turns one call at a time, so a change of machine load (other processes on a
    shared machine) hits every model alike instead of whichever was measured at that moment.
    A model stops once it has ``min_runs`` calls and has used ``budget_s`` seconds.
    """
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for fn in models.values():
            fn(*args)  # warm-up
        for _ in range(rounds):
            active = [
                name for name, ts in times.items() if len(ts) < min_runs or sum(ts) < budget_s
            ]
            if not active:
                break
            for name in active:
                start = time.perf_counter()
                models[name](*args)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _saved_bytes(obj: object) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's ``state_dict`` as ``torch.save`` writes it.

    Constants a lowered graph reads with ``get_attr`` that are not in the state dict (packed
    weight objects) are counted too, when they can be saved.
    """
    total = _saved_bytes(model.state_dict())
    if isinstance(model, fx.GraphModule):
        state = model.state_dict()
        for node in model.graph.nodes:
            if node.op != "get_attr" or node.target in state:
                continue
            obj = attr_at(model, str(node.target))
            if obj is None or isinstance(obj, torch.nn.Module):
                continue
            try:
                total += _saved_bytes(obj)
            except Exception:  # an object torch.save cannot write adds nothing we can measure
                continue
    return total
