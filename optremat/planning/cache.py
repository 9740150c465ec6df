"""The offline plan cache: a directory of plans keyed by everything that decides a plan.

The key hashes the graph's fingerprint (ops, shapes, dtypes, edges), the budget in bytes,
the solver and its options, the cost model and device, and optremat's version. Entries
are written atomically (a temporary file renamed into place) under a per-key file lock,
so several processes planning the same key at once solve it once and all read one valid
entry. Each entry carries a checksum of its plan: a truncated or corrupted entry is
reported as a warning and re-solved, never loaded. A plan found under a time limit is
reused only if it was proven optimal or the new call allows no more time.

A cache that cannot be written (a read-only directory, a full disk) still serves the
entries it holds; a plan it cannot store is returned all the same, with a warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

from optremat.core.solution import OPTIMAL
from optremat.planning.result import write_atomically

T = TypeVar("T")

KEY = "[0-9a-f]" * 32
"""A glob matching a key (`PlanCache.key`): the cache lists and clears only its own files,
never a plan a user saved in the same directory."""

CACHE_FORMAT = 2
"""The entry format (2: plans that carry their own checksum); an entry of another
format is a miss, replaced when the key is planned again."""


@dataclass(frozen=True)
class Entry:
    """One cached plan, as `optremat cache list` shows it."""

    key: str
    path: Path
    bytes: int
    solver: str
    status: str
    budget_bytes: int
    predicted_overhead: float
    time_limit: float


class PlanCache:
    """Plans stored under `directory`, one JSON file per key. A plan is stored as the JSON
    it serializes to (with `solver`, `status`, `budget_bytes` and `predicted_overhead`
    fields) and read back through the loader the caller passes."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @staticmethod
    def key(**parts: Any) -> str:
        """A stable hash of the named parts (the caller passes everything that decides a plan)."""
        text = json.dumps(parts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.plan.json"

    @contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Hold the key's lock: other processes planning the same key wait here. In a
        directory this process cannot write, nothing is locked: its entries are read as
        they are (entries are replaced atomically) and nothing will be stored."""
        handle = self._lock_file(key)
        if handle is None:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _lock_file(self, key: str) -> IO[str] | None:
        """The key's lock file, opened (and the directory made) if this process can."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return open(self.directory / f"{key}.lock", "a")
        except OSError:
            return None

    def get(self, key: str, time_limit: float, load: Callable[[dict[str, Any]], T]) -> T | None:
        """The cached plan for `key`, read by `load` from its JSON, if present, intact and
        good enough for `time_limit`."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            entry = _read_entry(path)
            if entry is None:
                return None
            plan = load(entry["plan"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(f"optremat: plan cache entry {path} is corrupted ({error}); planning again", stacklevel=3)
            return None
        if entry["plan"]["status"] != OPTIMAL and time_limit > entry["time_limit"]:
            return None
        return plan

    def put(self, key: str, body: dict[str, Any], time_limit: float) -> bool:
        """Store a plan's JSON atomically: readers see the old entry or the new one, never
        half of one. A plan that cannot be stored is reported as a warning naming the
        directory and the OS error, not raised: the caller still has its plan. Returns
        whether the entry was stored."""
        text = json.dumps(body, sort_keys=True)
        entry = {"format": CACHE_FORMAT, "checksum": hashlib.sha256(text.encode()).hexdigest(),
                 "time_limit": time_limit, "plan": body}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(self._path(key), json.dumps(entry))
        except OSError as error:
            warnings.warn(f"optremat: could not store the plan in the plan cache {self.directory} ({error}); "
                          "it is used but not cached", stacklevel=3)
            return False
        return True

    def entries(self) -> list[Entry]:
        """Every entry on disk (corrupted ones are listed with status CORRUPTED, those of
        another cache format with OTHER FORMAT)."""
        out = []
        for path in sorted(self.directory.glob(f"{KEY}.plan.json")):
            key = path.name.removesuffix(".plan.json")
            try:
                entry = _read_entry(path)
            except (OSError, ValueError):
                out.append(Entry(key, path, path.stat().st_size, "-", "CORRUPTED", 0, 0.0, 0.0))
                continue
            if entry is None:
                out.append(Entry(key, path, path.stat().st_size, "-", "OTHER FORMAT", 0, 0.0, 0.0))
                continue
            plan = entry["plan"]
            out.append(Entry(key, path, path.stat().st_size, plan["solver"], plan["status"], plan["budget_bytes"],
                             plan["predicted_overhead"], entry["time_limit"]))
        return out

    def clear(self) -> int:
        """Remove every entry, lock file and temporary file a write left behind (a process
        killed mid-write); returns how many entries were removed."""
        removed = 0
        for path in self.directory.glob(f"{KEY}.plan.json"):
            path.unlink(missing_ok=True)
            removed += 1
        for pattern in (f"{KEY}.lock", f".{KEY}.plan.json.*.tmp"):
            for path in self.directory.glob(pattern):
                path.unlink(missing_ok=True)
        return removed


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_ENTRY_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "checksum": (lambda v: isinstance(v, str), "text"),
    "time_limit": (lambda v: _is_number(v) and v >= 0, "a number of seconds >= 0"),
    "plan": (lambda v: isinstance(v, dict), "a JSON object"),
}
"""The fields of an entry of this cache format, what each must be and how to say so."""

_PLAN_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "solver": (lambda v: isinstance(v, str), "text"),
    "status": (lambda v: isinstance(v, str), "text"),
    "budget_bytes": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                     "a whole number of bytes > 0"),
    "predicted_overhead": (_is_number, "a number"),
}
"""The fields of an entry's plan that the cache reads itself (the loader checks the rest)."""


def _read_entry(path: Path) -> dict[str, Any] | None:
    """The entry stored at `path`, or None if it is of another cache format (a miss).
    ValueError saying what is wrong with anything else that is not one intact entry (not
    JSON, not an object, a field missing or of the wrong type, a plan that does not match
    its checksum), so that every malformed entry reads as corrupted; OSError if it cannot
    be read."""
    entry = json.loads(path.read_text())
    if not isinstance(entry, dict):
        raise ValueError("the entry is not a JSON object")
    if entry.get("format") != CACHE_FORMAT:
        return None
    _check_fields(entry, _ENTRY_FIELDS, "its")
    _check_fields(entry["plan"], _PLAN_FIELDS, "its plan's")
    text = json.dumps(entry["plan"], sort_keys=True)
    if hashlib.sha256(text.encode()).hexdigest() != entry["checksum"]:
        raise ValueError("checksum mismatch")
    return entry


def _check_fields(data: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]], whose: str) -> None:
    """ValueError naming the first of `fields` that `data` lacks or holds a wrong value for."""
    for name, (valid, shown) in fields.items():
        if name not in data or not valid(data[name]):
            raise ValueError(f"{whose} {name!r} is missing or not {shown}")
