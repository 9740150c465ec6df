"""The Python state of a model's modules: what tracing must leave as it found, and what
tells a module call that changes it (a rerun under checkpoint would change it again).

Tracing runs the model's own forward on fake tensors. A forward that caches a tensor in
an attribute (a rotary table filled on first use, a buffer registered as None and set
later) or counts its calls keeps what the trace gave it unless it is put back: a fake
tensor where a real one belongs turns every later loss and gradient fake. A forward that
updates a plain tensor attribute in place (a statistic kept outside the buffers) updates
the real tensor even on fake inputs. `kept` restores every module's attributes as they
were, containers (dicts, lists, sets) in place one level down, and the contents of the
tensors among them (and in tuples) that were written over. `python_state` is the part of
a module's attributes a call can change (not its parameters, buffers, submodules or
hooks), compared before and after each call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

_OWN = frozenset(nn.Module().__dict__)
"""The attributes every nn.Module has: parameters, buffers, submodules, hooks, mode."""

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


@contextmanager
def kept(model: nn.Module) -> Iterator[None]:
    """While it lasts, `model`'s modules may change their attributes; then every module
    that was in the model holds what it held before, and only that."""
    saved = [(module, dict(module.__dict__), {name: _contents(value) for name, value in module.__dict__.items()
                                              if isinstance(value, (dict, list, set))})
             for module in model.modules()]
    values = {id(t): (t, t._version, t.detach().to("cpu", copy=True)) for module in model.modules()
              for t in _tensors(module)}
    try:
        yield
    finally:
        for module, attributes, contents in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for name, content in contents.items():
                _refill(attributes[name], content)
        with torch.no_grad():
            for tensor, version, value in values.values():
                if tensor._version != version:
                    (tensor if tensor.shape == value.shape else tensor.resize_(value.shape)).copy_(value)


def python_state(module: nn.Module) -> tuple[Any, ...]:
    """What a call of `module` could change of its own Python state: each attribute that
    is not an nn.Module's own, by value where it is plain data, else by identity, a
    container's entries one level down."""
    return tuple((name, _entries(value)) for name, value in module.__dict__.items() if name not in _OWN)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The real tensors among `module`'s own attributes, containers one level down (not
    its parameters or buffers, which tracing replaces, nor inference tensors, which
    nothing outside inference mode writes). Their copies wait on the host: a cache kept
    as an attribute on a GPU is not doubled there."""
    found = []
    for name, value in module.__dict__.items():
        if name in _OWN:
            continue
        inside = value.values() if isinstance(value, dict) else value if isinstance(value, (list, set, tuple)) else ()
        found += [t for t in (value, *inside) if isinstance(t, torch.Tensor) and not t.is_meta and not t.is_inference()]
    return found


def _identity(value: Any) -> Any:
    return value if isinstance(value, _PLAIN) else ("id", id(value))


def _entries(value: Any) -> Any:
    if isinstance(value, dict):
        return ("dict", id(value), tuple((_identity(k), _identity(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("list", id(value), tuple(_identity(v) for v in value))
    if isinstance(value, tuple):  # a shape set again as the same tuple changes nothing
        return ("tuple", tuple(_identity(v) for v in value))
    return _identity(value)


def _contents(container: dict | list | set) -> Any:
    return dict(container) if isinstance(container, dict) else list(container)


def _refill(container: dict | list | set, content: Any) -> None:
    if isinstance(container, list):
        container[:] = content
    else:
        container.clear()
        container.update(content)
