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
objects and generators among those attributes and globals too. `kept` restores all of it as it was, and
the contents of tensors among the modules' attributes (containers one level down) that
were written over. `python_state` is all of it but the module's parameters, buffers,
submodules and hooks, compared before and after each call.
"""

from __future__ import annotations

import builtins
import os
import pickle
import random
import sys
import sysconfig
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

_OWN = frozenset(nn.Module().__dict__)
"""The attributes every nn.Module has: parameters, buffers, submodules, hooks, mode."""

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
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
_REFRESHED: dict[type, tuple[str, ...]] = {nn.RNNBase: ("_flat_weights", "_flat_weight_refs")}
"""Attributes a module's forward sets again from its parameters, the same on every call:
an RNN's lists of its weights and of references to them, rebuilt when they were swapped (as
tracing swaps them)."""
WALK_LIMIT = 4096
"""The most objects one walk visits: a module holding a large structure is walked so far."""
_MISSING = object()


@contextmanager
def kept(model: nn.Module) -> Iterator[None]:
    """While it lasts, `model`'s modules may change their attributes and what they reach;
    then every module that was in the model holds what it held before, and only that, and
    so does every object, generator, class attribute and global they reach."""
    modules = list(model.modules())
    saved = [(module, dict(module.__dict__), {name: _contents(value) for name, value in module.__dict__.items()
                                              if isinstance(value, (dict, list, set))})
             for module in modules]
    reached = _reachable(_roots(modules))
    contents = [(value, _snapshot(value)) for value in reached]
    plain = [(space, dict(_plain_items(space))) for space in _namespaces(modules)]
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
                if name not in _OWN and name not in refreshed)
    reached = tuple((id(value), _fingerprint(value)) for value in _reachable(_roots([module], refreshed)))
    return own, reached, tuple(tuple(_plain_items(space).items()) for space in _namespaces([module]))


def _roots(modules: Iterable[nn.Module], skipped: Iterable[str] = ()) -> list[Any]:
    """What a walk starts from: the values among the attributes of the modules' classes
    and the globals of their forwards that the user wrote, then the modules' own
    attributes (walked first, so that large globals cannot crowd them out)."""
    own = [value for module in modules for name, value in module.__dict__.items()
           if name not in _OWN and name not in skipped]
    return [value for space in _namespaces(modules) if _users(space)
            for name, value in list(_namespace_items(space)) if not _dunder(name)] + own


_LIBRARIES = tuple({os.path.realpath(sysconfig.get_paths()[kind]) + os.sep
                    for kind in ("stdlib", "platstdlib", "purelib", "platlib")}
                   | {os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep})
"""Where installed packages, the standard library and optremat itself live."""


def _users(space: Any) -> bool:
    """Whether a class or module namespace was written outside the installed packages,
    the standard library and optremat (a script, a notebook, the user's own package): libraries keep
    registries there that their own hooks must agree with."""
    name = space.get("__name__") if isinstance(space, dict) else space.__module__
    path = getattr(sys.modules.get(name), "__file__", None) if name is not None else None
    return path is None or not os.path.realpath(path).startswith(_LIBRARIES)


def _namespace_items(space: Any) -> Iterable[tuple[str, Any]]:
    return (space if isinstance(space, dict) else vars(space)).items()


def _namespaces(modules: Iterable[nn.Module]) -> list[Any]:
    """The classes of `modules` below nn.Module and the globals of their forwards, once each."""
    found: dict[int, Any] = {}
    for module in modules:
        for cls in type(module).__mro__:
            if cls is nn.Module:
                break
            found.setdefault(id(cls), cls)
        space = getattr(getattr(type(module), "forward", None), "__globals__", None)
        if space is not None:
            found.setdefault(id(space), space)
    return list(found.values())


def _plain_items(space: Any) -> dict[str, Any]:
    return {name: value for name, value in list(_namespace_items(space))
            if isinstance(value, _PLAIN) and not _dunder(name)}


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _set(space: Any, name: str, value: Any) -> None:
    if isinstance(space, dict):
        space[name] = value
    else:
        setattr(space, name, value)


def _reachable(roots: Iterable[Any]) -> list[Any]:
    """The containers, plain objects and generators reachable from `roots`, at most
    WALK_LIMIT of them."""
    namespaces, seen = _namespace_ids(), set()
    found: list[Any] = []
    todo = list(roots)
    while todo and len(found) < WALK_LIMIT:
        value = todo.pop()
        if id(value) in seen or id(value) in namespaces or isinstance(value, _PLAIN + _OPAQUE):
            continue
        seen.add(id(value))
        if isinstance(value, _GENERATORS):
            found.append(value)
        elif isinstance(value, dict):
            found.append(value)
            todo += [item for pair in _items(value) for item in pair]
        elif isinstance(value, (list, set)):
            found.append(value)
            todo += _members(value)
        elif isinstance(value, tuple):
            todo += _members(value)
        elif isinstance(getattr(value, "__dict__", None), dict):
            found.append(value)
            todo += list(vars(value).values())
    return found


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
    return next((state for kind, state in _GENERATOR_STATES.items() if isinstance(value, kind)), None)


def _snapshot(value: Any) -> Any:
    state = _generator_state(value)
    if state is not None:
        return state[0](value)
    if isinstance(value, (dict, list, set)):
        return _contents(value)
    return dict(vars(value))


def _changed(value: Any, content: Any) -> bool:
    """Whether `value` holds other than its snapshot `content`, entry by entry by identity."""
    now = _snapshot(value)
    if isinstance(value, _GENERATORS):
        return pickle.dumps(now) != pickle.dumps(content)
    ids = lambda c: [(id(k), id(v)) for k, v in c.items()] if isinstance(c, dict) else [id(v) for v in c]  # noqa: E731
    return ids(now) != ids(content)


def _restore(value: Any, content: Any) -> None:
    state = _generator_state(value)
    if state is not None:
        state[1](value, content)
    elif isinstance(value, (dict, list, set)):
        _refill(value, content)
    else:
        vars(value).clear()
        vars(value).update(content)


def _fingerprint(value: Any) -> Any:
    if isinstance(value, _GENERATORS):
        return pickle.dumps(_snapshot(value))
    if isinstance(value, (dict, list, set)):
        return _entries(value)
    return ("object", tuple((name, _identity(v)) for name, v in vars(value).items()))


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The real tensors among `module`'s own attributes, containers one level down (not
    its parameters or buffers, which tracing replaces, nor inference tensors, which
    nothing outside inference mode writes). Their copies wait on the host: a cache kept
    as an attribute on a GPU is not doubled there."""
    found = []
    for name, value in module.__dict__.items():
        if name in _OWN:
            continue
        inside = ([v for _, v in _items(value)] if isinstance(value, dict)
                  else _members(value) if isinstance(value, (list, set, tuple)) else ())
        found += [t for t in (value, *inside) if isinstance(t, torch.Tensor) and not t.is_meta and not t.is_inference()]
    return found


def _identity(value: Any) -> Any:
    return value if isinstance(value, _PLAIN) else ("id", id(value))


def _entries(value: Any) -> Any:
    if isinstance(value, set):
        return ("set", id(value), frozenset(_identity(v) for v in _members(value)))
    if isinstance(value, dict):
        return ("dict", id(value), tuple((_identity(k), _identity(v)) for k, v in _items(value)))
    if isinstance(value, list):
        return ("list", id(value), tuple(_identity(v) for v in _members(value)))
    if isinstance(value, tuple):  # a shape set again as the same tuple changes nothing
        return ("tuple", tuple(_identity(v) for v in _members(value)))
    return _identity(value)


def _items(container: dict) -> list[tuple[Any, Any]]:
    """A dict's entries as stored: a subclass's own lookup (transformers' ACT2FN builds an
    object on each) is not run."""
    return list(dict.items(container))


def _members(container: list | set | tuple) -> list[Any]:
    base = list if isinstance(container, list) else set if isinstance(container, set) else tuple
    return list(base.__iter__(container))


def _contents(container: dict | list | set) -> Any:
    return dict(_items(container)) if isinstance(container, dict) else _members(container)


def _refill(container: dict | list | set, content: Any) -> None:
    if isinstance(container, list):
        container[:] = content
    else:
        container.clear()
        container.update(content)
