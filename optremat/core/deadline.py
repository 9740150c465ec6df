"""Work cut short at a wall-clock deadline: a step is begun only when a step as long as
the last one would end by it, so that a time limit bounds the whole, not the start of
its last step."""

from __future__ import annotations

import time


def ends_before(deadline: float | None, took: float) -> bool:
    """Whether work taking `took` seconds, begun now, ends by `deadline` (a
    `time.perf_counter` time; None: no limit)."""
    return deadline is None or time.perf_counter() + took < deadline
