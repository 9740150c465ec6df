"""Fake tensors a trace left in the Python caches of a model's code, taken out again.

A trace runs the model's forward on fake tensors. A forward that caches a tensor it
computed (a causal mask, a relative-position table) keeps the fake one where the cache
holds it, and every later step of the model reads it: losses and gradients come out
fake. `module_state.kept` puts back what the model's modules and the user's globals
reach; a cache elsewhere (a mutable default argument, a closure's dict, an `lru_cache` in
an installed library, as transformers' `compile_compatible_method_lru_cache`) is not
reached so. `swept` finds, once a planning call returned or failed (its frames' names
cleared), every fake tensor of a trace's fake modes still alive, and takes it out of what
holds it: an `lru_cache` is cleared, a dict that is a cache (`_a_cache`) loses the
entries holding it, through up to three tuples, lists or deques. One held otherwise (an
object's attribute, an nn.Module's buffers, a partial's keywords, a closure's variable)
cannot be taken out without losing what was there before: a call that returned raises
`FakeTensorLeft`, naming what to do; one that failed warns so, its own error going on.

Looking through the whole heap after every planning call took most of a small model's
planning time, so the collector's objects are frozen (`gc.freeze`) while planning calls
run, and a sweep looks through only what they made; garbage from before them is
collected once they return. A trace outside any planning call leaves the next call's
sweep looking through the whole heap. A caller that froze the heap itself keeps it
frozen: where planning left a fake tensor, the heap is unfrozen while the sweep looks for
what holds it, and frozen again, with what planning kept.
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
import threading
import traceback
import types
import warnings
import weakref
from typing import Any, Callable, TypeVar

import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_MODES: weakref.WeakSet[FakeTensorMode] = weakref.WeakSet()
"""The fake modes traces ran in (`traced_in`)."""

_LOCK = threading.Lock()
_ACTIVE = [0]
"""Planning calls running in any thread: a sweep runs only when the last one returns,
with no other trace's fake tensors alive."""

_FROZEN = [False]
"""Whether the first running planning call froze the collector's objects (`gc.freeze`):
then only what the calls made since is collected and looked through, not the whole heap."""

_INTERNAL = (types.FrameType, types.TracebackType, BaseException, torch.fx.Node, torch.fx.Graph,
             torch.fx.GraphModule, torch.fx.Tracer, FakeTensorMode)
"""What holds a trace's own fake tensors (a trace still running, or a failed one's error
and frames)."""

_UNSWEPT = [False]
"""Whether a trace ran outside any planning call, or a sweep passed over more fake
tensors than it looks at (`MOST_SWEPT`): what they left is older than the next planning
call, whose sweep then looks through the whole heap."""

_LEFT: dict[int, weakref.ref] = {}
"""The fake tensors of the last sweep that left one where it could not take it out: a
later sweep looks for them again, although the heap from before it is frozen."""

_LRU = functools._lru_cache_wrapper
_CONTAINERS = (tuple, list, collections.deque)

MOST_SWEPT = 256
"""The most fake tensors a sweep looks at: more are a caller's traces still alive (a
`Traced` it holds), whose tensors cannot be told from a cache's; none is swept then."""

F = TypeVar("F", bound=Callable[..., Any])


class FakeTensorLeft(RuntimeError):
    """A trace left a fake tensor where the model's later steps would read it, in a place
    optremat cannot restore."""


def traced_in(mode: FakeTensorMode | None) -> None:
    """Note a fake mode a trace ran in: its tensors still alive after planning are leaks.
    A trace outside any planning call (`extract.trace`) is swept by the next call, over
    the whole heap."""
    if mode is not None:
        _MODES.add(mode)
        if _ACTIVE[0] == 0:
            _UNSWEPT[0] = True


def swept(function: F) -> F:
    """`function` (a planning call), after which no fake tensor of a trace stays in the
    Python caches its model's code reached."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            _ACTIVE[0] += 1
            if _ACTIVE[0] == 1 and not _UNSWEPT[0] and gc.get_freeze_count() == 0 and gc.isenabled():
                gc.freeze()
                _FROZEN[0] = True
        failed = False
        try:
            return function(*args, **kwargs)
        except Exception as error:
            failed = True
            _let_go(error)
            raise
        finally:
            with _LOCK:  # held through the sweep: a planning call starting meanwhile waits
                _ACTIVE[0] -= 1
                if _ACTIVE[0] == 0:
                    _sweep(failed)

    return call  # type: ignore[return-value]


def _let_go(error: BaseException) -> None:
    """Clear the names of the frames `error` (and what it was raised from) passed through,
    so that the traces they held are gone: the frames and lines stay for the traceback."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _sweep(failed: bool = False) -> None:
    """Take the fake tensors left out of caches; raise FakeTensorLeft for one that cannot
    be, or after a `failed` call (whose own error goes on) warn.

    A fake tensor left is one the planning calls made, or one an earlier sweep could not
    take out (`_LEFT`). So while the heap from before the calls is frozen, collecting and
    looking through what they made finds it; those a failed call's trace alone still
    holds are let be. What holds one may be older, so the heap is unfrozen while `_places`
    looks for that (and frozen again after, where the caller had frozen it)."""
    ours, callers = _FROZEN[0], not _FROZEN[0] and gc.get_freeze_count() > 0
    try:
        fakes = _fakes_left(frozen=ours or callers)
    finally:
        if ours:
            gc.unfreeze()
            _FROZEN[0] = False
    if not ours:
        _UNSWEPT[0] = False
    if len(fakes) > MOST_SWEPT:
        _UNSWEPT[0] = True
        return
    _LEFT.clear()
    if not fakes:
        return
    if callers:
        gc.unfreeze()
    try:
        left = _release(_places(fakes))
    finally:
        if callers:
            gc.freeze()
    if left:
        _LEFT.update((id(f), weakref.ref(f)) for f in fakes)
        message = (f"optremat: tracing left a fake tensor in {left[0]}, where the model's later steps would read it "
                   "and compute fake losses and gradients: run the model once on a batch of the planned shapes "
                   "before planning, so that what its code caches is real")
        if failed:
            warnings.warn(message, stacklevel=4)
        else:
            raise FakeTensorLeft(message)


def _fakes_left(frozen: bool) -> list[FakeTensor]:
    """The fake tensors of the traces' modes still alive where the collector looks (what
    the planning calls made, if the heap from before them is `frozen`), but those a
    failed call's trace alone holds; and those an earlier sweep could not take out."""
    fakes = []
    if _MODES:
        gc.collect()
        fakes = [o for o in gc.get_objects() if type(o) is FakeTensor and o.fake_mode in _MODES]
        if frozen and fakes and _held_by_traces_alone(fakes):
            fakes = []
    found = {id(f) for f in fakes}
    return fakes + [f for f in (ref() for ref in _LEFT.values()) if f is not None and id(f) not in found]


def _held_by_traces_alone(fakes: list[FakeTensor]) -> bool:
    """Whether only a trace's own objects (a failed call's trace, its error and frames)
    hold `fakes`, through up to three tuples, lists or deques. Looked for first among
    what the planning calls made, while the heap from before them is still frozen (so
    each `gc.get_referrers` looks through only that), then, for those with references
    not found there, through the heap: those found nowhere are held by C++ (an autograd
    graph's saved tensors), which no Python cache is."""
    level: list[Any] = fakes
    seen, unseen = {id(fakes)}, []
    for _ in range(4):
        if not level:
            break
        holders = [h for h in gc.get_referrers(*level) if id(h) not in seen]
        seen.update([id(holders), *map(id, holders)])
        unseen += _references_unseen(level, holders)
        owned = _a_traces_own([h for h in holders if isinstance(h, dict)])
        if any(not isinstance(h, (*_CONTAINERS, *_INTERNAL)) and id(h) not in owned for h in holders):
            return False
        level = [h for h in holders if isinstance(h, _CONTAINERS)]
        seen.add(id(level))
    if level:
        return False
    gc.unfreeze()
    try:
        return not unseen or all(id(h) in seen for h in gc.get_referrers(*unseen) if h is not unseen)
    finally:
        gc.freeze()


def _references_unseen(objects: list[Any], holders: list[Any]) -> list[Any]:
    """Those of `objects` with more references than `holders` make to them, beside the
    list `objects` (and what reading the count adds, which Pythons differ in)."""
    made = dict.fromkeys(map(id, objects), 0)
    for holder in holders:
        for held in gc.get_referents(holder):
            if id(held) in made:
                made[id(held)] += 1
    alone = _reference_counts([object()])[0]  # what the list and the reading add, on this Python
    return [o for o, count in zip(objects, _reference_counts(objects)) if count - alone != made[id(o)]]


def _reference_counts(objects: list[Any]) -> list[int]:
    return [sys.getrefcount(o) for o in objects]


def _places(fakes: list[FakeTensor]) -> list[tuple[Any, Any]]:
    """Where the fake tensors are kept outside a trace's own objects, as (holder, what it
    holds: the tensor, or a container holding it): what holds each, and, up to three
    tuples, lists or deques above it, the dicts and caches holding those."""
    found: list[tuple[Any, Any]] = []
    level, ours = list(fakes), {id(fakes), id(found)}
    for depth in range(4):
        holders = _holders(level, ours)
        containers = {}
        for held in level:
            for holder in holders.get(id(held), ()):
                if isinstance(holder, _CONTAINERS):
                    if depth < 3:
                        containers[id(holder)] = holder
                elif depth == 0 or isinstance(holder, dict) or type(holder) is _LRU or _lru_entry(holder):
                    found.append((holder, held))
        ours.update([id(level), id(holders), id(containers), *map(id, holders.values())])
        level = list(containers.values())
    return found


def _holders(objects: list[Any], ours: set[int]) -> dict[int, list[Any]]:
    """id(object) -> what holds it, but for a trace's own objects, this module's frames and
    the sweep's own lists and dicts (`ours`): two passes over the heap."""
    if not objects:
        return {}
    wanted = {id(o) for o in objects}
    holders = [h for h in gc.get_referrers(*objects)
               if h is not objects and id(h) not in ours and not isinstance(h, _INTERNAL)]
    owned = _a_traces_own([h for h in holders if isinstance(h, dict)])
    found: dict[int, list[Any]] = {}
    for holder in holders:
        if id(holder) in owned:
            continue
        for held in gc.get_referents(holder):
            if id(held) in wanted:
                found.setdefault(id(held), []).append(holder)
    return found


def _a_traces_own(dicts: list[dict]) -> set[int]:
    """The ids of those `dicts` that a trace's own objects hold: an fx node's metadata, a
    traced graph's constants, and a tracer's and its root module's names (fx's tracer of a
    function sets the constants it meets on a bare `nn.Module`)."""
    if not dicts:
        return set()
    owners = gc.get_referrers(*dicts)
    roots = [o for o in owners if type(o) is nn.Module]
    tracers = [t for t in gc.get_referrers(*roots) if isinstance(t, torch.fx.Tracer)] if roots else []
    traced = {id(t.root) for t in tracers if isinstance(getattr(t, "root", None), nn.Module)}
    return {id(d) for owner in owners
            if isinstance(owner, (torch.fx.Node, torch.fx.GraphModule, torch.fx.Tracer)) or id(owner) in traced
            for d in gc.get_referents(owner)}


def _release(places: list[tuple[Any, Any]]) -> list[str]:
    """Take what each place holds out of it; the places it could not be taken from, described."""
    lru = _lru_caches() if any(isinstance(holder, dict) or _lru_entry(holder) for holder, _ in places) else {}
    dicts = {id(h): h for h, _ in places if isinstance(h, dict) and id(h) not in lru}
    ours = {id(dicts), *(id(place) for place in places)}
    caches = {key: _a_cache(d, ours) for key, d in dicts.items()}
    left = []
    for holder, held in places:
        if type(holder) is _LRU:
            holder.cache_clear()
        elif id(holder) in lru:
            lru[id(holder)].cache_clear()
        elif caches.get(id(holder)):
            for key in [k for k, v in holder.items() if v is held]:
                del holder[key]
        else:
            left.append(_described(holder))
    return left


def _lru_caches() -> dict[int, Any]:
    """Each `lru_cache`'s own dict and entries (by id) -> the cache."""
    found = {}
    for wrapper in gc.get_objects():  # type(), not isinstance(): that reads __class__, which some objects warn on
        if type(wrapper) is _LRU:
            own = getattr(wrapper, "__dict__", None)
            for d in gc.get_referents(wrapper):
                if isinstance(d, dict) and d is not own:
                    found[id(d)] = wrapper
                    found.update({id(entry): wrapper for entry in d.values() if _lru_entry(entry)})
    return found


def _lru_entry(o: Any) -> bool:
    """Whether `o` is an entry of a bounded `lru_cache` (C's `_lru_list_elem`)."""
    return type(o).__name__ == "_lru_list_elem"


def _a_cache(d: dict, ours: set[int]) -> bool:
    """Whether `d` is a cache: a dict held only by closures, tuples and lists (a
    function's default argument), or as a value in the names of a module or a plain
    object (not an nn.Module's own dicts, nor a partial's keywords); `ours`, the sweep's
    own holders, aside."""
    for holder in gc.get_referrers(d):
        if id(holder) in ours or isinstance(holder, (types.CellType, types.FrameType)):
            continue
        if isinstance(holder, _CONTAINERS):  # a default argument's tuple, a list of caches
            continue
        if isinstance(holder, dict) and getattr(holder, "__dict__", None) is not d:
            owners = [o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder]
            if owners and not any(isinstance(o, nn.Module) for o in owners):
                continue
        return False
    return True


def _described(holder: Any) -> str:
    if isinstance(holder, dict):
        owners = [h for h in gc.get_referrers(holder) if not isinstance(h, types.FrameType)]
        owner = next((h for h in owners if getattr(h, "__dict__", None) is holder), None)
        if owner is not None:
            return f"an attribute of a {type(owner).__name__}"
        return f"a dict held by a {type(owners[0]).__name__}" if owners else "a dict"
    if isinstance(holder, types.CellType):
        return "a variable a closure holds"
    return f"a {type(holder).__name__}"
