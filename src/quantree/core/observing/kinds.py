"""Which observer a spec asks for: its ``ObserverKind``, per tensor or per channel."""

from __future__ import annotations

from quantree.core.observing.channel_search import ChannelSearchObserver
from quantree.core.observing.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    Observer,
)
from quantree.core.observing.search import RangeSearchObserver
from quantree.core.specs import ObserverKind, QuantSpec

PER_TENSOR: dict[ObserverKind, type[Observer]] = {
    ObserverKind.MINMAX: MinMaxObserver,
    ObserverKind.MOVING_AVERAGE: MovingAverageMinMaxObserver,
    ObserverKind.HISTOGRAM: HistogramObserver,
    ObserverKind.SEARCH: RangeSearchObserver,
}


def make_observer(spec: QuantSpec, label: str) -> Observer:
    """The observer a spec asks for.

    Per-channel specs (weights) use min-max per channel, or the exact per-channel search
    for ``SEARCH``: a constant is seen whole, so nothing needs averaging or a histogram.
    """
    if spec.axis is not None:
        if spec.observer is ObserverKind.SEARCH:
            return ChannelSearchObserver(spec, label)
        return MinMaxObserver(spec, label)
    return PER_TENSOR[spec.observer](spec, label)
