"""The native runtime: a plan installed on the user's own module.

Each module call a plan checkpoints runs its own forward under `torch.utils.checkpoint`
(non-reentrant). A region whose policy saves ops gets PyTorch's selective checkpointing
(`create_selective_checkpoint_contexts`) with a policy keyed by (op, occurrence in the
call), the key `optremat.regions` prices. Everything else is the user's model as it is:
its Python forward runs on every step, hooks fire, parameters and `state_dict()` are
untouched, and a plan keyed by module call and op occurrence holds at any input shape.

Two pieces of state must not change when a region reruns: checkpoint restores the RNG
state, so random ops (never saved by a plan) draw the same numbers; and buffers the
forward writes in place (BatchNorm's running statistics) are swapped for scratch copies
while the region reruns, so a step updates them once, as the unplanned step does.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from optremat.extract import tracing
from optremat.fingerprint import model_fingerprint
from optremat.regions import Region, parse_span

_RUNTIME = "_optremat_runtime"
_REGION = "_optremat_region"


class PlanMismatch(ValueError):
    """A plan applied to a model it was not made for."""


Choose = Callable[[tuple], "tuple[Region, ...]"]
"""Given a training forward's positional inputs, the regions to run it under."""


class _Runtime:
    """A model's installed plan: its regions by (module path, call) (for a span of a
    Sequential's children, a list of (start, stop, region)), the mode it was made for,
    how many calls of each planned module the current forward has made, and what picks
    the regions for a forward's inputs, if anything does."""

    def __init__(self, regions: tuple[Region, ...], training: bool, hook: Any, choose: Choose | None,
                 mutated_buffers: tuple[str, ...]) -> None:
        self.training = training
        self.hook = hook
        self.choose = choose
        self.mutated_buffers = mutated_buffers
        self.calls: Counter[str] = Counter()
        self.use(regions)

    def use(self, regions: tuple[Region, ...]) -> None:
        """Run later forwards under `regions` (their modules must be taken over)."""
        self.regions: dict[tuple[str, int], Region] = {}
        self.spans: dict[tuple[str, int], list[tuple[int, int, Region]]] = {}
        for region in regions:
            span = parse_span(region.path)
            if span is None:
                self.regions[(region.path, region.call)] = region
            else:
                self.spans.setdefault((span[0], region.call), []).append((span[1], span[2], region))

    def next_call(self, path: str) -> int:
        call = self.calls[path]
        self.calls[path] += 1
        return call

    @property
    def paths(self) -> list[str]:
        """Modules whose forward the plan takes over."""
        return list(dict.fromkeys([path for path, _ in self.regions] + [path for path, _ in self.spans]))


class _RegionState:
    """What a checkpointed module keeps: its path, its forward before the plan, the
    buffers its forward writes, and the model's runtime."""

    def __init__(self, path: str, forward: Any, owned: bool, mutated: tuple[str, ...], runtime: _Runtime) -> None:
        self.path = path
        self.forward = forward
        self.owned = owned
        self.mutated = mutated
        self.runtime = runtime


def install(model: nn.Module, regions: tuple[Region, ...], *, training: bool, fingerprint: str,
            mutated_buffers: tuple[str, ...] = (), choose: Choose | None = None) -> nn.Module:
    """Run `model`'s training steps under `regions`, or under those `choose` picks for a
    forward's inputs; returns `model` itself."""
    if fingerprint != model_fingerprint(model):
        raise PlanMismatch(f"this plan was made for another model (fingerprint {fingerprint}, this model gives "
                           f"{model_fingerprint(model)}); plan again")
    if regions and getattr(getattr(model, "config", None), "use_cache", False):
        warnings.warn("optremat: model.config.use_cache is True: a checkpointed call that writes into a key/value "
                      "cache created outside it sees another cache when it reruns, and checkpoint raises; set "
                      "use_cache=False for training, as transformers' own gradient checkpointing does", stacklevel=3)
    remove(model)
    runtime = _Runtime(regions, training, model.register_forward_pre_hook(_new_forward), choose, mutated_buffers)
    setattr(model, _RUNTIME, runtime)
    # a chooser may make the model itself a region after its forward was looked up: take it over now
    for path in runtime.paths + ([""] if choose is not None else []):
        _take_over(model, path)
    return model


def _take_over(model: nn.Module, path: str) -> None:
    """Route the module at `path` through `_region_forward` (once)."""
    runtime: _Runtime = getattr(model, _RUNTIME)
    module = model.get_submodule(path)
    if _REGION in module.__dict__:
        return
    owned = "forward" in module.__dict__
    prefix = f"{path}." if path else ""
    mutated = tuple(name.removeprefix(prefix) for name in runtime.mutated_buffers if name.startswith(prefix))
    setattr(module, _REGION, _RegionState(path, module.forward if owned else type(module).forward, owned,
                                          mutated, runtime))
    module.forward = types.MethodType(_region_forward, module)


def remove(model: nn.Module) -> nn.Module:
    """Undo `install`: the model runs as it did before the plan; returns `model`."""
    runtime = getattr(model, _RUNTIME, None)
    if runtime is None:
        return model
    runtime.hook.remove()
    for module in model.modules():
        state = module.__dict__.pop(_REGION, None)
        if state is not None:
            if state.owned:
                module.forward = state.forward
            else:
                del module.forward
    delattr(model, _RUNTIME)
    return model


def _new_forward(model: nn.Module, args: tuple) -> None:
    runtime: _Runtime = getattr(model, _RUNTIME)
    runtime.calls.clear()
    if (runtime.choose is not None and not tracing() and torch.is_grad_enabled()
            and model.training == runtime.training):
        runtime.use(runtime.choose(args))
        for path in runtime.paths:
            _take_over(model, path)


def _region_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _RegionState = getattr(module, _REGION)
    original = state.forward if state.owned else types.MethodType(state.forward, module)
    if tracing() or not torch.is_grad_enabled() or module.training != state.runtime.training:
        return original(*args, **kwargs)
    call = state.runtime.next_call(state.path)
    region = state.runtime.regions.get((state.path, call))
    if region is not None:
        return checkpoint(original, *args, use_reentrant=False, context_fn=_context_fn(module, state.mutated, region),
                          **kwargs)
    spans = state.runtime.spans.get((state.path, call))
    if spans is None:
        return original(*args, **kwargs)
    return _run_spans(module, state, {start: (stop, region) for start, stop, region in spans}, *args, **kwargs)


def _run_spans(module: nn.Sequential, state: _RegionState, spans: dict[int, tuple[int, Region]],
               value: Any) -> Any:
    """A Sequential's forward, each planned run of children under checkpoint."""
    children = list(module)
    k = 0
    while k < len(children):
        if k not in spans:
            value = children[k](value)
            k += 1
            continue
        stop, region = spans[k]
        names = list(module._modules)[k:stop]
        mutated = tuple(m for m in state.mutated if m.split(".")[0] in names)
        value = checkpoint(_run_children, children[k:stop], value, use_reentrant=False,
                           context_fn=_context_fn(module, mutated, region))
        k = stop
    return value


def _run_children(children: list[nn.Module], value: Any) -> Any:
    for child in children:
        value = child(value)
    return value


def _context_fn(module: nn.Module, mutated: tuple[str, ...], region: Region) -> Any:
    buffers = [(module.get_submodule(owner), name) for owner, _, name in (m.rpartition(".") for m in mutated)]
    return functools.partial(_contexts, region, buffers)


def _contexts(region: Region, buffers: list[tuple[nn.Module, str]]) -> tuple[Any, Any]:
    """The forward's and the recomputation's contexts for one call of a region. Under
    torch.compile the policy marks the traced ops and the partitioner recomputes them (no
    Python rerun, so no scratch buffers), and dynamo takes only selective policies' contexts."""
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_policy(region.saved))
    if not region.saved:
        return contextlib.nullcontext(), _scratch(buffers)
    forward, recompute = create_selective_checkpoint_contexts(_policy(region.saved))
    return forward, _rerun(_scratch(buffers), recompute)


def _policy(saved: frozenset[tuple[str, int]]) -> Any:
    """Save the outputs of the ops keyed in `saved`, recompute every other op."""
    seen: Counter[str] = Counter()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        op = str(func).removeprefix("aten.")
        key = (op, seen[op])
        seen[op] += 1
        return CheckpointPolicy.MUST_SAVE if key in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def _rerun(scratch: Any, recompute: Any) -> Iterator[None]:
    """Scratch buffers first: their copies must not pass through the selective mode."""
    with scratch, recompute:
        yield


@contextlib.contextmanager
def _scratch(buffers: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Swaps the named buffers for copies while a region reruns, so the rerun's in-place
    writes (BatchNorm's running statistics) do not reach the model."""
    real = [owner._buffers[name] for owner, name in buffers]
    for (owner, name), tensor in zip(buffers, real):
        owner._buffers[name] = tensor.detach().clone()
    try:
        yield
    finally:
        for (owner, name), tensor in zip(buffers, real):
            owner._buffers[name] = tensor
