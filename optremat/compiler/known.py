"""Plans the compile backend found in this process, per graph and configuration, so that
planning a graph again at another budget never returns a dearer plan than one already
known to fit it.

A search under a time limit can return a dearer plan at a larger budget than it found at
a smaller one (resnet-mini under Inductor: +3.8% at 187.72 MiB after +1.4% at 185.62 MiB,
a plan that fits both), and with it a larger peak at the smaller budget. Each plan the
backend returns is remembered under a key naming everything that decides its price (the
graph, its op costs, how it runs); the plans remembered under the same key compete at
every later budget. Of those, only the plans no other beats on both predicted peak and
predicted overhead are kept, for the GRAPHS graphs planned most recently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from optremat.planning.result import Plan

GRAPHS = 64
"""Keys whose plans are kept; the least recently used is dropped beyond that, so that a
process compiling graph after graph does not hold every plan it ever made."""

_KNOWN: OrderedDict[str, list[Plan]] = OrderedDict()
_LOCK = threading.Lock()


def known(key: str) -> list[Plan]:
    """The plans remembered under `key`, least peak first."""
    with _LOCK:
        return sorted(_KNOWN.get(key, ()), key=lambda plan: plan.predicted_peak_bytes)


def remember(key: str, plan: Plan) -> None:
    """Keep `plan` under `key` unless a remembered plan beats it on both peak and
    overhead; drop the remembered plans it beats so."""
    with _LOCK:
        plans = [p for p in _KNOWN.get(key, ()) if not _beats(plan, p)]
        if not any(_beats(p, plan) for p in plans):
            plans.append(plan)
        _KNOWN[key] = plans
        _KNOWN.move_to_end(key)
        while len(_KNOWN) > GRAPHS:
            _KNOWN.popitem(last=False)


def forget() -> None:
    """Drop every remembered plan (each later compile plans as if it were the first)."""
    with _LOCK:
        _KNOWN.clear()


def _beats(a: Plan, b: Plan) -> bool:
    return a.predicted_peak_bytes <= b.predicted_peak_bytes and a.predicted_overhead <= b.predicted_overhead
