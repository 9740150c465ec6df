"""Fake tensors a trace left in the Python caches of a model's code, taken out again.

A trace runs the model's forward on fake tensors. A forward that caches a tensor it
computed (a causal mask, a relative-position table) keeps the fake one where the cache
holds it, and every later step of the model reads it: losses and gradients come out
fake. `module_state.kept` puts back what the model's modules and the user's globals
reach; a cache elsewhere (a mutable default argument, a closure's dict, an `lru_cache` in
an installed library, as transformers' `compile_compatible_method_lru_cache`) is not
reached so. `swept` finds, once a planning call returned, every fake tensor of a trace's
fake modes still alive, and takes it out of what holds it: an `lru_cache` is cleared, a
plain dict (a cache) loses the entries holding it, through tuples and lists holding it;
a fake tensor held otherwise (an object's attribute, a module's global, a closure's
variable) cannot be taken out without losing what was there before, and is refused
(`FakeTensorLeft`), naming what to do.
"""

from __future__ import annotations

import functools
import gc
import threading
import types
import weakref
from typing import Any, Callable, TypeVar

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_MODES: weakref.WeakSet[FakeTensorMode] = weakref.WeakSet()
"""The fake modes traces ran in (`traced_in`)."""

_LOCK = threading.Lock()
_ACTIVE = [0]
"""Planning calls running in any thread: a sweep runs only when the last one returns,
with no other trace's fake tensors alive."""

_INTERNAL = (types.FrameType, types.TracebackType, torch.fx.Node, torch.fx.Graph, torch.fx.GraphModule,
             FakeTensorMode)
"""What holds a trace's own fake tensors (a trace still running, or an exception's frames)."""

_LRU = functools._lru_cache_wrapper

F = TypeVar("F", bound=Callable[..., Any])


class FakeTensorLeft(RuntimeError):
    """A trace left a fake tensor where the model's later steps would read it, in a place
    optremat cannot restore."""


def traced_in(mode: FakeTensorMode | None) -> None:
    """Note a fake mode a trace ran in: its tensors still alive after planning are leaks."""
    if mode is not None:
        _MODES.add(mode)


def swept(function: F) -> F:
    """`function` (a planning call), after which no fake tensor of a trace stays in the
    Python caches its model's code reached."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            _ACTIVE[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            with _LOCK:
                _ACTIVE[0] -= 1
                last = _ACTIVE[0] == 0
            if last and _MODES:
                _sweep()  # raising past a refusal too: a model left computing fake values matters more

    return call  # type: ignore[return-value]


def _sweep() -> None:
    gc.collect()
    fakes = [o for o in gc.get_objects() if type(o) is FakeTensor and o.fake_mode in _MODES]
    if not fakes:
        return
    places = _places(fakes)
    del fakes
    left = _release(places)
    if left:
        raise FakeTensorLeft(f"optremat: tracing left a fake tensor in {left[0]}, where the model's later steps "
                             "would read it and compute fake losses and gradients: run the model once on a batch "
                             "of the planned shapes before planning, so that what its code caches is real")


def _places(fakes: list[FakeTensor]) -> list[tuple[Any, Any]]:
    """Where the fake tensors are kept outside a trace's own objects, as (holder, what it
    holds: the tensor, or a tuple or list holding it): the holders of each, and of each
    tuple or list holding one, the dicts and caches."""
    direct = _holders(fakes)
    found = [(holder, fake) for fake in fakes for holder in direct.get(id(fake), ())
             if not isinstance(holder, (tuple, list))]
    containers = list({id(h): h for hs in direct.values() for h in hs if isinstance(h, (tuple, list))}.values())
    above = _holders(containers)
    found += [(holder, container) for container in containers for holder in above.get(id(container), ())
              if isinstance(holder, dict) or (type(holder) is _LRU or _lru_entry(holder))]
    return found


def _holders(objects: list[Any]) -> dict[int, list[Any]]:
    """id(object) -> what holds it, but for a trace's own objects and this module's frames
    (one pass over the heap)."""
    if not objects:
        return {}
    wanted = {id(o) for o in objects}
    found: dict[int, list[Any]] = {}
    for holder in gc.get_referrers(*objects):
        if holder is objects or isinstance(holder, _INTERNAL) or isinstance(holder, dict) and _internal(holder):
            continue
        for held in gc.get_referents(holder):
            if id(held) in wanted:
                found.setdefault(id(held), []).append(holder)
    return found


def _internal(d: dict) -> bool:
    """Whether `d` is a trace's own (an fx node's metadata)."""
    return any(isinstance(holder, torch.fx.Node) for holder in gc.get_referrers(d))


def _release(places: list[tuple[Any, Any]]) -> list[str]:
    """Take what each place holds out of it; the places it could not be taken from, described."""
    lru = _lru_caches() if any(isinstance(holder, dict) or _lru_entry(holder) for holder, _ in places) else {}
    left = []
    for holder, held in places:
        if type(holder) is _LRU:
            holder.cache_clear()
        elif id(holder) in lru:
            lru[id(holder)].cache_clear()
        elif isinstance(holder, dict) and _a_cache(holder):
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


def _a_cache(d: dict) -> bool:
    """Whether `d` is a dict of its own (a cache), not an object's, class's or module's namespace."""
    return not any(isinstance(holder, (types.ModuleType, type)) or getattr(holder, "__dict__", None) is d
                   for holder in gc.get_referrers(d))


def _described(holder: Any) -> str:
    if isinstance(holder, dict):
        owner = next((h for h in gc.get_referrers(holder) if getattr(h, "__dict__", None) is holder), None)
        return f"an attribute of a {type(owner).__name__}" if owner is not None else "a module's or class's names"
    if isinstance(holder, types.CellType):
        return "a variable a closure holds"
    return f"a {type(holder).__name__}"
