"""Memory budgets: what users may write, and the error for one that cannot be met."""

from __future__ import annotations

import math
import numbers
import re

import numpy as np

from optremat.core.graph import Graph, format_bytes
from optremat.core.schedule import keep_all, simulate

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
ACCEPTED = "a budget is an int of bytes, a size such as '6GiB' or '500MB', or a fraction in (0, 1] of the unplanned peak"


class InfeasibleBudget(ValueError):
    """No plan fits `budget` bytes; `smallest` is the least peak known to be achievable.

    `proven` says whether `smallest` is proven minimal (by an exact solver, within the
    plans `scope` describes) or only the best a planner reached; `floor`, when known, is
    a peak no plan goes below (`peak_floor`), which proves a budget under it impossible
    without proving `smallest` minimal. `note` says what else limits the plans (the
    module calls none checkpoints). `bound`, when known, is the least overhead (a fraction
    of the step's cost) any plan of a narrower scope could have under the budget, from a
    search that bounded those plans but found none (a chain's composition: plans of
    regions inside its blocks; infinite when it proved none of them fits).
    """

    def __init__(self, budget: int, smallest: int, planner: str, proven: bool = False, scope: str = "",
                 floor: int | None = None, note: str = "", bound: float | None = None) -> None:
        how = f"smallest feasible budget{scope}" if proven else "smallest budget it reaches"
        under = f"; no plan fits under {format_bytes(floor)}" if floor is not None and not proven else ""
        super().__init__(f"budget {format_bytes(budget)} is infeasible for {planner}; "
                         f"{how}: {format_bytes(smallest)} ({smallest} bytes){under}{'; ' + note if note else ''}")
        self.budget = budget
        self.smallest = smallest
        self.planner = planner
        self.proven = proven
        self.floor = floor
        self.note = note
        self.bound = bound

    @property
    def impossible(self) -> bool:
        """Whether no plan fits the budget is proven, not only that none was found."""
        return self.proven or (self.floor is not None and self.budget < self.floor)


_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*")
"""A number, optionally with a unit: "0.5", "1e9", "6GiB", "500 MB"."""


def _spelled(text: str) -> tuple[float, str] | None:
    """The number and the (lower-case) unit `text` spells, or None if it spells none."""
    match = _NUMBER.fullmatch(text.lower())
    if not match or match.group(2) not in _UNITS:
        return None
    return float(match.group(1)), match.group(2)


def _whole_bytes(value: float, unit: str) -> int | None:
    """Bytes meant by `value` `unit`s: whole bytes when counted in bytes, rounded down
    from a larger unit ("1.5KiB" is 1536 bytes, "1.5" bytes is not a size); None when not
    at least one byte."""
    if unit in ("", "b") and not value.is_integer():
        return None
    count = int(value * _UNITS[unit])
    return count if count >= 1 else None


def parse_size(text: str) -> int:
    """Bytes meant by a size: a whole number of bytes, or a number with a unit such as
    "16GiB" or "500MB"."""
    spelled = _spelled(str(text))
    count = None if spelled is None else _whole_bytes(*spelled)
    if count is None:
        raise ValueError(f"memory size {text!r} is not understood; give whole bytes or a size such as '16GiB' "
                         "or '500MB'")
    return count


def resolve_budget(graph: Graph, budget: int | float | str) -> int:
    """Bytes meant by `budget` on `graph` (a fraction is of the unplanned simulated peak)."""
    value = check_budget(budget)
    if isinstance(value, float):
        return math.ceil(value * simulate(graph, keep_all(graph)).peak_bytes)
    return value


def check_budget(budget: int | float | str) -> int | float:
    """`budget` as bytes (an int) or a fraction of the unplanned peak (a float in (0, 1]);
    ValueError for anything else. Numpy numbers count as the Python numbers they equal;
    a string means the number it spells: a fraction in (0, 1] or whole bytes, or a size
    with a unit."""
    if isinstance(budget, (bool, np.bool_)):
        raise ValueError(f"budget {budget!r} is not understood; {ACCEPTED}")
    if isinstance(budget, str):
        return _budget_of_text(budget)
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise ValueError(f"budget {budget!r} is not understood: bytes must be > 0; {ACCEPTED}")
        return int(budget)
    if isinstance(budget, numbers.Real):
        value = float(budget)
        if not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError(f"budget {budget!r} is not understood: a float is a fraction in (0, 1] (give bytes "
                             f"as an int); {ACCEPTED}")
        return value
    raise ValueError(f"budget {budget!r} ({type(budget).__name__}) is not understood; {ACCEPTED}")


def _budget_of_text(text: str) -> int | float:
    """The budget a string spells: a unitless number up to 1 is a fraction, any other
    number must be whole bytes ("1.5" is neither), a number with a unit is a size."""
    spelled = _spelled(text)
    if spelled is None:
        raise ValueError(f"budget {text!r} is not understood; {ACCEPTED}")
    value, unit = spelled
    if value == 0:
        raise ValueError(f"budget {text!r} is zero; {ACCEPTED}")
    if unit == "" and value <= 1:
        return value
    count = _whole_bytes(value, unit)
    if count is None:
        what = {"": "neither a fraction in (0, 1] nor a whole number of bytes",
                "b": "not a whole number of bytes"}.get(unit, "under one byte")
        raise ValueError(f"budget {text!r} is {what}; {ACCEPTED}")
    return count
