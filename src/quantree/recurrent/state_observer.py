"""Recurrent states are calibrated on their extremes, whatever the activation observer.

A moving-average observer trades the extremes for a range that ignores rare outliers; on
an ordinary activation that costs the clipped values once. A hidden state is different: what
a layer outputs at step t is what step t + 1 reads. Whole mode's native kernel requantizes
the fed-back h at every step on a grid covering the output sequence's, the initial and the
returned state's ranges (``backends/cpu/rules/recurrent/layers.py``), and cells mode's ``hidden``
point is the state ``h_prev`` reads, so a clipped h feeds its error into every later step.
And h has no outliers to be robust against: an LSTM's or tanh RNN's lies in (-1, 1), a GRU's
within its initial state's bound; larger inputs just drive it towards the bound.

So the recipes calibrate those points on their running min-max: in whole mode the output
sequence and every initial and returned state (``c_n`` too: a streaming model feeds it
back as the next call's ``c_0``; inside, the kernel keeps c in float), in cells mode
``hidden`` and ``h_prev`` (a grid of its own, which also covers the initial state; a
``hidden`` pinned in ``points`` keeps the spec given, and ``h_prev`` shares it).
Cells mode's int8 ``cell`` point keeps the observer asked for: c is unbounded and requantized
every step, so there the range trades clipping against resolution (min-max on it lost
resolution where the initial cell states were drawn wide; an int16 cell state is min-max
anyway). The measurements: ``benchmarks/README.md``, "Recurrent layers: packed cells mode,
int8 packing, states and moving averages".
"""

from __future__ import annotations

import dataclasses

from quantree.core.specs import ObserverKind, QuantSpec


def state_spec(act: QuantSpec) -> QuantSpec:
    """``act`` calibrated on its running extremes (min-max), everything else as given."""
    if act.observer is ObserverKind.MINMAX:
        return act
    return dataclasses.replace(act, observer=ObserverKind.MINMAX)
