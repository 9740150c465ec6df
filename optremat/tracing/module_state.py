"""The Python state of a model's modules: what tracing must leave as it found, and what
tells a module call that changes it (a rerun under checkpoint would change it again).

Tracing runs the model's own forward on fake tensors. A forward that caches a tensor in
an attribute (a rotary table filled on first use, a buffer registered as None and set
later, a table kept per device and length in a dict of dicts, or on a helper object the
blocks share) or counts its calls keeps what the trace gave it unless it is put back: a
fake tensor where a real one belongs turns every later loss and gradient fake. A forward
that updates a plain tensor attribute in place (a statistic kept outside the buffers)
updates the real tensor even on fake inputs.

What a module reaches (`_reachable`): its attributes, and through containers (dicts,
lists, sets, tuples) and plain objects' attributes what they hold, not through other
modules, tensors, classes or functions; random number generators held so (numpy's and
Python's); the plain values of its class's attributes and of the globals its forward
reads; and where the user wrote that class or forward (not an installed package or the
standard library, whose registries their own hooks must agree with), the containers,
objects of the user's classes and generators among those attributes and globals, and
among the globals of the user's own modules and functions they hold. `kept` restores
all of it as it was (an lru_cache the trace filled is cleared), and the contents of
tensors among the modules' attributes (containers one level down) that were written
over. `python_state` is all of it but the module's parameters, buffers,
submodules and hooks, compared before and after each call.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import operator
import os
import pickle
import random
import sys
import sysconfig
import types
from collections import OrderedDict, deque
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

_OWN = frozenset(nn.Module().__dict__)
"""The attributes every nn.Module has: parameters, buffers, submodules, hooks, mode."""
INSTALLED = ("_optremat_runtime", "_optremat_region")
"""The attributes an applied plan sets on modules (`optremat.runtime.native`), with the
forward it installs: its own state, which a new shape's plan, traced inside a planned
step, changes as it runs."""

PLAIN = (type(None), bool, int, float, complex, str, bytes)
"""The types of plain values, compared and kept by value."""
_GENERATOR_STATES: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], None]]] = {
    random.Random: (random.Random.getstate, random.Random.setstate),
    np.random.Generator: (lambda g: g.bit_generator.state, lambda g, state: setattr(g.bit_generator, "state", state)),
    np.random.RandomState: (np.random.RandomState.get_state, np.random.RandomState.set_state),
}
"""How the state of each kind of generator is read and set."""
_GENERATORS = tuple(_GENERATOR_STATES)
_OPAQUE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType)
"""Values a walk does not enter: modules (walked on their own), tensors, classes, functions."""
_NOT_OBJECTS = PLAIN + _OPAQUE
"""Values that are no plain object whose attributes a rerun gets back (`attribute_spaces`)."""
_REFRESHED: dict[type, tuple[str, ...]] = {nn.RNNBase: ("_flat_weights", "_flat_weight_refs")}
"""Attributes a module's forward sets again from its parameters, the same on every call:
an RNN's lists of its weights and of references to them, rebuilt when they were swapped (as
tracing swaps them)."""
WALK_LIMIT = 4096
"""The most values one walk visits: a module holding a large structure is walked so far."""
SHARED_LIMIT = 512
"""The most values one walk visits from the user's namespaces, where a training script
keeps its datasets: their caches sit near the top, and each module call is walked twice."""
_LRU_CACHE = functools._lru_cache_wrapper
_MISSING = object()


@contextmanager
def kept(model: nn.Module) -> Iterator[None]:
    """While it lasts, `model`'s modules may change their attributes and what they reach;
    then every module that was in the model holds what it held before, and only that, and
    so does every object, generator, class attribute and global they reach."""
    modules = list(model.modules())
    saved = [(module, dict(module.__dict__), {name: _contents(value) for name, value in module.__dict__.items()
                                              if _kind(value) in (dict, list, set)})
             for module in modules]
    spaces = _namespaces(modules)
    own, shared = _roots(modules, spaces)
    contents = [(value, _snapshot(value)) for value in _reachable(own, shared)]
    plain = [(space, dict(_plain_items(space))) for space in spaces]
    caches = [(cache, cache.cache_info().currsize) for cache in shared if isinstance(cache, _LRU_CACHE)]
    values = {id(t): (t, t._version, t.detach().to("cpu", copy=True)) for module in modules
              for t in _tensors(module)}
    try:
        yield
    finally:
        for module, attributes, own in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for name, content in own.items():
                _refill(attributes[name], content)
        for value, content in contents:
            if _changed(value, content):
                _restore(value, content)
        for cache, size in caches:  # a pure function's cache: what the trace added is dropped with the rest
            if cache.cache_info().currsize != size:
                cache.cache_clear()
        for space, items in plain:
            now = _plain_items(space)
            for name, value in items.items():
                if now.get(name, _MISSING) != value:
                    _set(space, name, value)
        with torch.no_grad():
            for tensor, version, value in values.values():
                if tensor._version != version:
                    (tensor if tensor.shape == value.shape else tensor.resize_(value.shape)).copy_(value)


def python_state(module: nn.Module) -> tuple[Any, ...]:
    """What a call of `module` could change of the Python state it reaches: each attribute
    that is not an nn.Module's own, by value where it is plain data, else by identity;
    every container and plain object it reaches by its entries; every generator by its
    state; its class's and its forward's globals' plain values."""
    refreshed = next((names for kind, names in _REFRESHED.items() if isinstance(module, kind)), ())
    own = tuple((name, _entries(value)) for name, value in module.__dict__.items()
                if not _ignored(name, value) and name not in refreshed)
    spaces = _namespaces([module])
    reached = tuple((id(value), _fingerprint(value)) for value in _reachable(*_roots([module], spaces, refreshed)))
    return own, reached, tuple(tuple(_plain_items(space).items()) for space in spaces)


def attribute_spaces(modules: Iterable[nn.Module]) -> list[tuple[Any, dict[str, Any]]]:
    """Each module with a copy of its `__dict__` as it is now, and each plain object one of
    them holds as an attribute (a model's config) with a copy of its own: what a rerun
    under checkpoint must find as the call found it (`restored_plain`). Each `__dict__`
    is copied whole: picking out its plain values took twice what the rest of a call's
    setup takes."""
    spaces: dict[int, tuple[Any, dict[str, Any]]] = {}
    for module in modules:
        spaces.setdefault(id(module), (module, dict(module.__dict__)))
        for name, value in module.__dict__.items():
            if (name in _OWN or isinstance(value, _NOT_OBJECTS) or id(value) in spaces or _kind(value) is not None
                    or _ignored(name, value)):
                continue
            space = _live_dict(value)
            if space is not None:
                spaces[id(value)] = (value, dict(space))
    return list(spaces.values())


@contextmanager
def restored_plain(spaces: list[tuple[Any, dict[str, Any]]]) -> Iterator[None]:
    """While it lasts, the attributes that hold plain values (a module's mode among them)
    in `spaces` (`attribute_spaces`) or in the objects now are those of `spaces`; then
    they are as they were."""
    changed = []
    for owner, before in spaces:
        now = _live_dict(owner)
        if len(now) == len(before) and all(map(operator.is_, now.values(), before.values())):
            continue  # the same names in the same order, each the same object (the usual case)
        names = [name for name, value in now.items() if before.get(name, _MISSING) is not value]
        for name in [*names, *(before.keys() - now.keys())]:
            then, current = before.get(name, _MISSING), now.get(name, _MISSING)
            if type(then) in PLAIN or type(current) in PLAIN:
                changed.append((now, name, current, then))
    for space, name, _, value in changed:
        _put(space, name, value)
    try:
        yield
    finally:
        for space, name, now, _ in reversed(changed):
            _put(space, name, now)


def _put(space: dict[str, Any], name: str, value: Any) -> None:
    if value is _MISSING:
        space.pop(name, None)
    else:
        space[name] = value


def _ignored(name: str, value: Any) -> bool:
    """Whether a module's attribute is no state of the user's: one every nn.Module has, or
    one an applied plan set (`INSTALLED`, and the forward it installed)."""
    if name in _OWN or name in INSTALLED:
        return True
    inner = value.func if isinstance(value, functools.partial) else value
    return name == "forward" and type(inner).__module__.partition(".")[0] == "optremat"


def _roots(modules: Iterable[nn.Module], spaces: list[Any],
           skipped: Iterable[str] = ()) -> tuple[list[Any], list[Any]]:
    """What a walk starts from: the modules' own attributes, and the values in those of
    their `spaces` (`_namespaces`) that the user wrote."""
    own = [value for module in modules for name, value in module.__dict__.items()
           if not _ignored(name, value) and name not in skipped]
    return own, [value for space in spaces if _users(space)
                 for name, value in list(_namespace_items(space)) if not _dunder(name)]


_LIBRARIES = tuple({os.path.realpath(sysconfig.get_paths()[kind]) + os.sep
                    for kind in ("stdlib", "platstdlib", "purelib", "platlib")}
                   | {os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep})
"""Where installed packages, the standard library and optremat itself live."""


def _users(space: Any) -> bool:
    """Whether a class or module namespace was written outside the installed packages,
    the standard library and optremat (a script, a notebook, the user's own package):
    libraries keep registries there that their own hooks must agree with."""
    name = space.get("__name__") if isinstance(space, dict) else space.__module__
    path = getattr(sys.modules.get(name), "__file__", None) if name is not None else None
    if path is None:  # a notebook's or an interactive interpreter's, not a builtin module's
        return name == "__main__"
    return _outside_libraries(path)


@functools.lru_cache(maxsize=None)
def _outside_libraries(path: str) -> bool:
    return not os.path.realpath(path).startswith(_LIBRARIES)


def _namespace_items(space: Any) -> Iterable[tuple[str, Any]]:
    return (space if isinstance(space, dict) else vars(space)).items()


def _namespaces(modules: Iterable[nn.Module]) -> list[Any]:
    """The classes of `modules` below nn.Module and the globals of their forwards, and for
    those the user wrote, the globals of the user's own modules and functions they hold (a
    helper file of rotary tables, `from rope import table`), once each."""
    spaces: dict[int, Any] = {}
    for module in modules:
        mro = type(module).__mro__
        forward = getattr(type(module), "forward", None)
        for space in (*mro[:mro.index(nn.Module)], getattr(forward, "__globals__", None)):
            if space is not None:
                spaces.setdefault(id(space), space)
    found = dict(spaces)
    for space in spaces.values():
        for _, value in list(_namespace_items(space)) if _users(space) else ():
            inner = _globals_of(value)
            if inner is not None and _users(inner):
                found.setdefault(id(inner), inner)
    return list(found.values())


def _globals_of(value: Any) -> dict[str, Any] | None:
    """The namespace of a module, or the globals of a plain function; None for anything else."""
    if issubclass(type(value), types.ModuleType):
        return vars(value)
    return value.__globals__ if type(value) is types.FunctionType else None


def _plain_items(space: Any) -> dict[str, Any]:
    return {name: value for name, value in list(_namespace_items(space))
            if isinstance(value, PLAIN) and not _dunder(name)}


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _set(space: Any, name: str, value: Any) -> None:
    if isinstance(space, dict):
        space[name] = value
    else:
        setattr(space, name, value)


def _reachable(own: Iterable[Any], shared: Iterable[Any] = ()) -> list[Any]:
    """The containers, objects and generators reachable from `own` (a module's attributes:
    any object's attributes entered) and from `shared` (values of the user's namespaces:
    only objects of classes the user wrote entered, not a logger's or a library's), breadth
    first, `own` first, queueing at most WALK_LIMIT values from `own` and SHARED_LIMIT
    from `shared`."""
    namespaces, seen = _namespace_ids(), set()
    found: list[Any] = []
    limits = {True: WALK_LIMIT, False: SHARED_LIMIT}
    first = [(value, True) for value in own][:WALK_LIMIT]
    then = [(value, False) for value in shared][:SHARED_LIMIT]
    todo, queued = deque(first + then), {True: len(first), False: len(then)}
    while todo:
        value, whole = todo.popleft()
        if id(value) in seen or id(value) in namespaces or isinstance(value, PLAIN + _OPAQUE):
            continue
        seen.add(id(value))
        kind, room = _kind(value), max(limits[whole] - queued[whole], 0)
        if issubclass(type(value), _GENERATORS):
            found.append(value)
            continue
        if kind is dict:
            inside = [item for pair in itertools.islice(dict.items(value), room) for item in pair]
        elif kind is not None:
            inside = list(itertools.islice(kind.__iter__(value), room))
        elif whole or _users(type(value)):
            attributes = _attributes(value)
            if attributes is None:
                continue
            inside = list(itertools.islice(attributes.values(), room))
        else:
            continue
        if kind is not tuple:
            found.append(value)
        todo.extend((item, whole) for item in inside)
        queued[whole] += len(inside)
    return found


def _kind(value: Any) -> type | None:
    """The builtin container `value`'s type derives from (a mock claiming to be a dict
    through `isinstance` is none)."""
    return next((base for base in (dict, list, set, tuple) if issubclass(type(value), base)), None)


def _attributes(value: Any) -> dict[str, Any] | None:
    """An object's attributes: its own `__dict__` (the live one), or its slots' values;
    None where it has neither, read without running its own attribute lookup."""
    space = _live_dict(value)
    if space is not None:
        return space
    slots = [name for cls in type(value).__mro__ for name in _slot_names(cls)]
    values = {}
    for name in slots:
        try:
            values[name] = object.__getattribute__(value, name)
        except AttributeError:  # a slot never set
            continue
    return values or None


def _live_dict(value: Any) -> dict[str, Any] | None:
    try:
        space = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None
    return space if isinstance(space, dict) else None


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    return tuple(name for name in ((slots,) if isinstance(slots, str) else slots)
                 if name not in ("__dict__", "__weakref__"))


_NAMESPACES: tuple[int, set[int]] = (-1, set())


def _namespace_ids() -> set[int]:
    """The ids of Python's modules' namespaces, which no walk enters (Dynamo puts the
    builtins' in the globals of the code it compiles)."""
    global _NAMESPACES
    if _NAMESPACES[0] != len(sys.modules):
        _NAMESPACES = (len(sys.modules), {id(vars(m)) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
                       | {id(vars(builtins))})
    return _NAMESPACES[1]


def _generator_state(value: Any) -> tuple[Callable[[Any], Any], Callable[[Any, Any], None]] | None:
    """How to read and set `value`'s state where it is a generator, else None."""
    return next((state for kind, state in _GENERATOR_STATES.items() if issubclass(type(value), kind)), None)


def _snapshot(value: Any) -> Any:
    state = _generator_state(value)
    if state is not None:
        return state[0](value)
    if _kind(value) in (dict, list, set):
        return _contents(value)
    return dict(_attributes(value) or {})


def _changed(value: Any, content: Any) -> bool:
    """Whether `value` holds other than its snapshot `content`, entry by entry by identity."""
    now = _snapshot(value)
    if _generator_state(value) is not None:
        return pickle.dumps(now) != pickle.dumps(content)
    ids = lambda c: [(id(k), id(v)) for k, v in c.items()] if isinstance(c, dict) else [id(v) for v in c]  # noqa: E731
    return ids(now) != ids(content)


def _restore(value: Any, content: Any) -> None:
    state = _generator_state(value)
    if state is not None:
        state[1](value, content)
    elif _kind(value) in (dict, list, set):
        _refill(value, content)
    elif (space := _live_dict(value)) is not None:
        space.clear()
        space.update(content)
    else:
        for name, item in content.items():
            object.__setattr__(value, name, item)


def _fingerprint(value: Any) -> Any:
    if _generator_state(value) is not None:
        return pickle.dumps(_snapshot(value))
    if _kind(value) in (dict, list, set):
        return _entries(value)
    return ("object", tuple((name, _identity(v)) for name, v in (_attributes(value) or {}).items()))


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The real tensors among `module`'s own attributes, containers one level down (not
    its parameters or buffers, which tracing replaces, nor inference tensors, which
    nothing outside inference mode writes). Their copies wait on the host: a cache kept
    as an attribute on a GPU is not doubled there."""
    found = []
    for name, value in module.__dict__.items():
        if _ignored(name, value):
            continue
        kind = _kind(value)
        inside = [v for _, v in _items(value)] if kind is dict else _members(value) if kind is not None else ()
        found += [t for t in (value, *inside) if isinstance(t, torch.Tensor) and not t.is_meta and not t.is_inference()]
    return found


def _identity(value: Any) -> Any:
    return value if isinstance(value, PLAIN) else ("id", id(value))


_ENDS = 64
"""Entries at each end by which a container larger than WALK_LIMIT is compared, with its length."""


def _entries(value: Any) -> Any:
    """A container by its entries (a large one by its length and the entries at its ends),
    anything else by `_identity`."""
    kind = _kind(value)
    if kind is None:
        return _identity(value)
    if kind is tuple:  # a shape set again as the same tuple changes nothing
        return ("tuple", tuple(_identity(v) for v in _members(value)))
    size = kind.__len__(value)
    entries = (_items(value) if kind is dict else _members(value)) if size <= WALK_LIMIT else _ends(value, kind)
    if kind is set:
        return ("set", id(value), size, frozenset(_identity(v) for v in entries))
    if kind is dict:
        return ("dict", id(value), size, tuple((_identity(k), _identity(v)) for k, v in entries))
    return ("list", id(value), size, tuple(_identity(v) for v in entries))


def _ends(value: Any, kind: type) -> list[Any]:
    if kind is dict:
        items = dict.items(value)
        return list(itertools.islice(items, _ENDS)) + list(itertools.islice(reversed(items), _ENDS))
    if kind is list:
        return list.__getitem__(value, slice(0, _ENDS)) + list.__getitem__(value, slice(-_ENDS, None))
    return list(itertools.islice(set.__iter__(value), _ENDS))


def _items(container: dict) -> list[tuple[Any, Any]]:
    """A dict's entries as stored: a subclass's own lookup (transformers' ACT2FN builds an
    object on each) is not run."""
    return list(dict.items(container))


def _members(container: list | set | tuple) -> list[Any]:
    return list(_kind(container).__iter__(container))


def _contents(container: dict | list | set) -> Any:
    return dict(_items(container)) if _kind(container) is dict else _members(container)


def _refill(container: dict | list | set, content: Any) -> None:
    """Put `content` back through the methods of the container's builtin type: a
    subclass's own `__setitem__` (a cache recording its writes) does not run again, and an
    OrderedDict keeps its order (and so its hooks)."""
    kind = _kind(container)
    if kind is list:
        list.__setitem__(container, slice(None), content)
    elif kind is set:
        set.clear(container)
        set.update(container, content)
    elif issubclass(type(container), OrderedDict):
        OrderedDict.clear(container)
        for key, item in content.items():
            OrderedDict.__setitem__(container, key, item)
    else:
        dict.clear(container)
        dict.update(container, content)
