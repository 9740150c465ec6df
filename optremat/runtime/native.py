"""The native runtime: a plan installed on the user's own module.

Each module call a plan checkpoints runs its own forward under `torch.utils.checkpoint`
(non-reentrant). A region whose policy saves ops gets PyTorch's selective checkpointing
(`create_selective_checkpoint_contexts`) with a policy keyed by (op, occurrence in the
call), the key `optremat.planners.regions` prices. Everything else is the user's model as it is:
its Python forward runs on every step, hooks fire, parameters and `state_dict()` are
untouched, and a plan keyed by module call and op occurrence holds at any input shape.
The one exception is a plan that runs a causal LM's head and loss in chunks: its
training steps run the forward the plan gives (`install(forward=...)`), which calls the
model's base model and takes the loss as the model's forward would.

Two pieces of state must not change when a region reruns: checkpoint restores the RNG
state, so random ops (never saved by a plan) draw the same numbers; and buffers the
forward writes (BatchNorm's running statistics, a counter reassigned) are swapped, while
the region reruns, for copies of what they held when the region first ran, so the rerun
computes what the forward computed and a step updates them once, as the unplanned step does.
What a training loop changes between the forward and the backward is met too: the plain
attributes of a module and of the plain objects it holds (a temperature schedule,
`model.eval()`, a config field set later in the step) are put back for the rerun as the
call found them, and a parameter or buffer written in place in between (an update under
`no_grad` before `loss.backward()`) stops the backward with an error naming it, where the
rerun would have computed other values silently.

A plan is checked against the model before anything is installed (`install`), and the
installed model pickles and loads with its plan (`torch.save(model)`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from optremat.planners.regions import Region, parse_span
from optremat.planning.native import runs_its_children
from optremat.runtime.caller import warn
from optremat.tracing.extract import host_random_kept, host_random_states, same_host_random, tracing
from optremat.tracing.fingerprint import model_fingerprint
from optremat.tracing.kv_cache import receives_cache
from optremat.tracing.module_state import INSTALLED, attribute_spaces, restored_plain

_RUNTIME, _REGION = INSTALLED
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The runtimes installed on a model now, each to a weak reference to its model (a
module copied from a planned one carries a copy of its runtime that no model runs)."""


class PlanMismatch(ValueError):
    """A plan applied to a model it was not made for."""


Choose = Callable[[tuple, dict], "tuple[Region, ...]"]
"""Given a training forward's positional and keyword arguments, the regions to run it under."""

Forward = Callable[..., Any]
"""What a planned step of a model runs in place of its forward, called as
`forward(model, own_forward, *args, **kwargs)`; it must pickle, as the model does."""


class _Runtime:
    """A model's installed plan: its regions by (module path, call) (for a span of a
    Sequential's children, a list of (start, stop, region)), the mode it was made for,
    how many calls of each planned module the current step has made, whether the
    current step runs planned, what picks the regions for a step's inputs, if anything,
    and what a planned step runs in place of the model's own forward, if anything."""

    def __init__(self, regions: tuple[Region, ...], training: bool, choose: Choose | None,
                 mutated_buffers: tuple[str, ...], forward: Forward | None) -> None:
        self.training = training
        self.choose = choose
        self.mutated_buffers = mutated_buffers
        self.forward = forward
        self.calls: Counter[str] = Counter()
        self.active = False
        self.warned = False
        self.left_out: set[str] = set()
        self.use(regions)

    def use(self, regions: tuple[Region, ...]) -> None:
        """Run later steps under `regions` (their modules must be taken over)."""
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
        """Modules whose forward the plan takes over: the model itself, which starts each
        step, and every planned module."""
        return list(dict.fromkeys([""] + [path for path, _ in self.regions] + [path for path, _ in self.spans]))

    @contextlib.contextmanager
    def step(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Iterator[None]:
        """One call of the model: counts start again, the plan runs when the model is in
        the mode it was planned in, with gradients on and no trace under way, and a
        chooser picks the regions for these inputs."""
        outer = self.active
        self.calls.clear()
        self.active = not tracing() and torch.is_grad_enabled() and model.training == self.training
        if not tracing() and torch.is_grad_enabled() and model.training != self.training:
            self._warn_mode(model)
        if self.active and self.choose is not None:
            self.use(self.choose(args, kwargs))
            for path in self.paths:
                _take_over(model, path)
        try:
            yield
        finally:
            self.active = outer

    def _warn_mode(self, model: nn.Module) -> None:
        if self.warned:
            return
        self.warned = True
        mode = ("train", "eval") if self.training else ("eval", "train")
        warn(f"optremat: the plan on {type(model).__name__} was made in {mode[0]} mode and the model runs "
             f"in {mode[1]} mode with gradients on: these steps run unplanned; plan again in "
             f"{mode[1]} mode (model.{mode[1]}()) to plan them")


class _RegionState:
    """What a taken-over module keeps: its path, its forward before the plan, whether
    that forward was its own attribute, the buffers its forward writes, and the model's
    runtime (None once the plan is removed while a later wrapper still calls through)."""

    def __init__(self, path: str, forward: Any, owned: bool, mutated: tuple[str, ...],
                 runtime: _Runtime | None) -> None:
        self.path = path
        self.forward = forward
        self.owned = owned
        self.mutated = mutated
        self.runtime = runtime

    def original(self, module: nn.Module) -> Callable:
        """The module's forward as it was before the plan."""
        return self.forward if self.owned else types.MethodType(self.forward, module)

    def calling(self, module: nn.Module) -> Callable:
        """`original`, as a partial where it is the class's: dynamo traces a partial, not
        a method made as the step runs (`torch.compile(..., fullgraph=True)`)."""
        return self.forward if self.owned else functools.partial(self.forward, module)


class _PlannedForward:
    """A taken-over module's `forward`: its calls go through the plan. An object rather
    than a bound function so that the model pickles (a bound method pickles as an
    attribute lookup the loading side cannot do); it shows the signature of the forward
    it stands for, which trainers read to pick a batch's columns."""

    steps_aside_while_tracing = True
    """Read by `tracing.repeat.alike`: a trace runs the forward this one replaced."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _region_forward(self.module, *args, **kwargs)

    @property
    def replaced(self) -> Callable:
        """The module's forward as it was before the plan."""
        return getattr(self.module, _REGION).original(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.replaced)


def install(model: nn.Module, regions: tuple[Region, ...], *, training: bool, fingerprint: str,
            mutated_buffers: tuple[str, ...] = (), choose: Choose | None = None,
            forward: Forward | None = None) -> nn.Module:
    """Run `model`'s training steps under `regions`, or under those `choose` picks for a
    step's inputs, and through `forward` in place of the model's own where given;
    returns `model` itself. Raises PlanMismatch, installing nothing, when the plan does
    not fit the model."""
    if fingerprint != model_fingerprint(model):
        raise PlanMismatch(f"this plan was made for another model (fingerprint {fingerprint}, this model gives "
                           f"{model_fingerprint(model)}); plan again")
    check(model, regions, mutated_buffers)
    _check_not_nested(model)
    remove(model)
    runtime = _Runtime(regions, training, choose, mutated_buffers, forward)
    setattr(model, _RUNTIME, runtime)
    _INSTALLED[runtime] = weakref.ref(model)
    for path in runtime.paths:
        _take_over(model, path)
    return model


def check(model: nn.Module, regions: tuple[Region, ...], mutated_buffers: tuple[str, ...]) -> None:
    """Raise PlanMismatch naming the first region or buffer of a plan that `model` cannot
    run as the plan says: a module path it lacks, a span of children of a module that is
    not a plain nn.Sequential (a subclass with its own forward computes more than its
    children) or outside its children, a negative call, a buffer it lacks."""
    for region in regions:
        span = parse_span(region.path)
        path = region.path if span is None else span[0]
        where = repr(path) if path else "the model itself"
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise PlanMismatch(f"the plan checkpoints {region.path!r}, and {type(model).__name__} has no module "
                               f"{path!r}; plan again for this model") from None
        if region.call < 0:
            raise PlanMismatch(f"the plan checkpoints call {region.call} of {region.path!r}: calls count from 0")
        if span is not None and not runs_its_children(module):
            raise PlanMismatch(f"the plan checkpoints children {span[1]}..{span[2] - 1} of {where} as a run, and "
                               f"{type(module).__name__} is not a plain nn.Sequential (its forward may compute more "
                               "than its children); plan again")
        if span is not None and not 0 <= span[1] < span[2] <= len(module):
            raise PlanMismatch(f"the plan checkpoints children {span[1]}..{span[2] - 1} of {where}, which has "
                               f"{len(module)}; plan again")
    buffers = dict(model.named_buffers())
    missing = [name for name in mutated_buffers if name not in buffers]
    if missing:
        raise PlanMismatch(f"the plan protects buffer {missing[0]!r}, and {type(model).__name__} has none of "
                           "that name; plan again")


def _check_not_nested(model: nn.Module) -> None:
    """Raise PlanMismatch where another model's plan is installed on a module of `model`
    or on a model holding it: a submodule planned on its own (a backbone planned, then
    put in a larger model), `model` a module of a planned model (whether or not that plan
    checkpoints it; `compile_causal_lm` takes over only the model itself), or modules
    another model's installed plan took over (`model` shares a module with one; a module
    copied from a planned model carries a copy of its plan that no model runs, and is
    planned anew). Each plan prices its
    model's step as the only plan running, and one inside the other kept both from
    running as planned: the step ran unplanned, over its budget, silently."""
    own = getattr(model, _RUNTIME, None)
    for runtime, planned in list(_INSTALLED.items()):
        outer = planned()
        if runtime is not own and outer is not None and any(module is model for module in outer.modules()):
            raise PlanMismatch(f"{type(model).__name__} is a module of a {type(outer).__name__} whose plan is "
                               "applied, and two plans cannot run one inside the other: apply only one of them "
                               "(optremat.remove on the other first)")
    for path, module in model.named_modules():
        if path and _RUNTIME in module.__dict__:
            raise PlanMismatch(f"{type(model).__name__}'s module {path!r} has a plan of its own applied, which "
                               "cannot run inside this one: take it off first (optremat.remove(model."
                               f"get_submodule({path!r}))) and let this plan cover the whole step")
        state = module.__dict__.get(_REGION)
        if state is not None and state.runtime is not own and state.runtime in _INSTALLED:
            runs = f"checkpoints its module {path!r}" if path else "runs its forward"
            raise PlanMismatch(f"{type(model).__name__} runs inside another model, or shares a module with one, "
                               f"whose plan {runs}, and two plans cannot run one inside the other: apply only one "
                               "of them (optremat.remove on the other first)")


def _take_over(model: nn.Module, path: str) -> None:
    """Route the module at `path` through `_region_forward` (once)."""
    runtime: _Runtime = getattr(model, _RUNTIME)
    module = model.get_submodule(path)
    buffers = dict(model.named_buffers())
    written = {id(buffers[name]) for name in runtime.mutated_buffers}
    # by identity: a module shared by several calls (one BatchNorm in every block) has its
    # buffers named under the first path alone
    mutated = tuple(name for name, buffer in module.named_buffers() if id(buffer) in written)
    state = module.__dict__.get(_REGION)
    if state is not None:  # taken over before: by this model's last plan, or in the model it was copied from
        state.path, state.runtime, state.mutated = path, runtime, mutated
        return
    owned = "forward" in module.__dict__
    setattr(module, _REGION, _RegionState(path, module.forward if owned else type(module).forward, owned,
                                          mutated, runtime))
    module.forward = _PlannedForward(module)


def remove(model: nn.Module) -> nn.Module:
    """Undo `install`: the model runs as it did before the plan; returns `model`. A
    forward another library wrapped around the plan's since (accelerate's hooks) stays,
    and calls through to the module's own forward."""
    if getattr(model, _RUNTIME, None) is None:
        return model
    for module in model.modules():
        state = module.__dict__.get(_REGION)
        if state is None:
            continue
        if not isinstance(module.__dict__.get("forward"), _PlannedForward):
            state.runtime = None
            continue
        del module.__dict__[_REGION]
        if state.owned:
            module.forward = state.forward
        else:
            del module.forward
    _INSTALLED.pop(getattr(model, _RUNTIME), None)
    delattr(model, _RUNTIME)
    return model


def _region_forward(module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
    state: _RegionState = getattr(module, _REGION)
    original = state.calling(module)
    runtime = state.runtime
    if runtime is None:
        return original(*args, **kwargs)
    if state.path == "":
        with runtime.step(module, args, kwargs):
            if runtime.active and runtime.forward is not None:
                original = functools.partial(runtime.forward, module, original)
            return _planned(module, state, runtime, original, *args, **kwargs)
    return _planned(module, state, runtime, original, *args, **kwargs)


def _planned(module: nn.Module, state: _RegionState, runtime: _Runtime, original: Callable, /, *args: Any,
             **kwargs: Any) -> Any:
    """One call of a taken-over module within a step: under checkpoint if the plan says so.
    A trace steps aside even inside a planned step (a shape replanned as the step starts)."""
    if not runtime.active or tracing():
        return original(*args, **kwargs)
    call = runtime.next_call(state.path)  # counted with gradients off too, as the trace counts calls
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    region = runtime.regions.get((state.path, call))
    if ((region is not None or (state.path, call) in runtime.spans)
            and _left_out(runtime, module, state.path, args, kwargs)):
        return original(*args, **kwargs)
    if region is not None:
        # the call's keywords bound here: checkpoint would take one named as its own options (`debug`)
        return checkpoint(functools.partial(original, **kwargs), *args, use_reentrant=False,
                          context_fn=_context_fn(module, [module], state.mutated, region))
    spans = runtime.spans.get((state.path, call))
    if spans is None:
        return original(*args, **kwargs)
    return _run_spans(module, state, {start: (stop, region) for start, stop, region in spans}, *args, **kwargs)


def _under_checkpoint() -> bool:
    """Whether this call runs inside `torch.utils.checkpoint` (its forward or its rerun in
    the backward), whose saved-tensor hooks are then the innermost."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__module__", "") == torch.utils.checkpoint.__name__


def _left_out(runtime: _Runtime, module: nn.Module, path: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a planned call of `module` runs as the model's own, with a warning once per
    reason: inside the user's own checkpoint (its rerun in the backward, where the plan
    no longer runs, must save what its forward saved), under a `torch.func` transform
    (`grad`, `vmap`: they take no saved-tensor hooks, so no checkpoint), handed a
    key/value cache, which its rerun would write again (`tracing.kv_cache`; plans made
    with the cache on leave such calls out, so this is a plan made with it off)."""
    if receives_cache(args, kwargs):
        reason = ("is handed a key/value cache, which a rerun would write again, so the plan's checkpointing there "
                  "is left out (the step's memory is not the plan's); set use_cache=False for training, or plan "
                  "with the cache on")
    elif torch._C._functorch.maybe_current_level() is not None:
        # the user's transform: the interpreter stack also holds dynamo's own while it traces
        reason = ("runs under a torch.func transform, which takes no checkpoint, so the plan's checkpointing there "
                  "is left out (the step's memory is not the plan's)")
    elif not torch.compiler.is_compiling() and _under_checkpoint():
        reason = ("runs inside torch.utils.checkpoint, so the plan's checkpointing there is left out (the step's "
                  "memory is not the plan's); remove that checkpoint to run the plan")
    else:
        return False
    if reason not in runtime.left_out:
        runtime.left_out.add(reason)
        warn(f"optremat: {path or 'the model'} {reason}")
    return True


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
                           context_fn=_context_fn(module, children[k:stop], mutated, region))
        k = stop
    return value


def _run_children(children: list[nn.Module], value: Any) -> Any:
    for child in children:
        value = child(value)
    return value


def _context_fn(module: nn.Module, running: list[nn.Module], mutated: tuple[str, ...], region: Region) -> Any:
    """The context function of a region of `module` (its `mutated` buffers named from it),
    run by the modules `running` (the module, or the children of its span). Under
    torch.compile the policy marks the traced ops and the partitioner recomputes them (no
    Python rerun, so no scratch buffers); dynamo takes only selective policies' contexts,
    made from constants."""
    if torch.compiler.is_compiling():
        return functools.partial(_selective, region.saved)
    buffers = [(module.get_submodule(owner), name) for owner, _, name in (m.rpartition(".") for m in mutated)]
    return functools.partial(_contexts, running, region, buffers)


def _selective(saved: frozenset[tuple[str, int]]) -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_policy(saved))


def _contexts(running: list[nn.Module], region: Region, buffers: list[tuple[nn.Module, str]]) -> tuple[Any, Any]:
    """The forward's and the recomputation's contexts for one call of a region run by the
    modules `running`, made as the call starts (so the tensors it reads, the buffers it
    writes and the plain attributes of its modules are taken as they are then)."""
    held = [(owner, name, owner._buffers[name].detach().clone()) for owner, name in buffers
            if owner._buffers.get(name) is not None]
    owners = list(dict.fromkeys(owner for module in running for owner in module.modules()))
    tensors = _tensors_of(owners, {(id(owner), name) for owner, name in buffers})
    found = _Found(region.path, tensors, [None if _unchecked(t) else t._version for *_, t in tensors],
                   attribute_spaces(owners), host_random_states())
    if not region.saved:
        return _drawing_seen(found, contextlib.nullcontext()), _Rerun(found, held, None)
    forward, recompute = create_selective_checkpoint_contexts(_policy(region.saved))
    return _drawing_seen(found, forward), _Rerun(found, held, recompute)


@contextlib.contextmanager
def _drawing_seen(found: "_Found", forward: Any) -> Iterator[None]:
    """The forward's context `forward`, noting in `found` whether the call drew from
    numpy's or Python's generators (`_Rerun` puts them back only for one that did)."""
    with forward, _parametrizations_computed():
        yield
    found.drew = not same_host_random(found.random_states, host_random_states())


@contextlib.contextmanager
def _parametrizations_computed() -> Iterator[None]:
    """The parametrized weights a checkpointed call reads computed by the call, in its
    forward and its rerun alike, under `parametrize.cached()` too (as the plan's trace
    computed them): a call finding one cached in its forward and not in its rerun, or the
    other way round (a backward run outside `cached()`, a first call computing the cache),
    ran other ops in each, and checkpoint stopped the backward."""
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled


def _unchecked(tensor: torch.Tensor) -> bool:
    """Whether a rerun leaves `tensor` unchecked for writes since its call: an inference
    tensor keeps no version, and a parameter with a hook run once its gradient is
    accumulated (an optimizer stepping it inside the backward, as PyTorch's tutorial does)
    is written in the backward, before the rerun of a call whose last op adds it, with no
    recomputed value reading it."""
    return tensor.is_inference() or bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


class _Found:
    """What one call of a region found as it started: the tensors its modules held, their
    version counters (None for those left unchecked, `_unchecked`), a copy of the
    `__dict__` of each of its modules and of the plain objects they hold
    (`module_state.attribute_spaces`), and the states of numpy's and Python's random
    number generators (`host_random_states`)."""

    def __init__(self, path: str, tensors: "Tensors", versions: list[int | None],
                 attributes: list[tuple[Any, dict[str, Any]]], random_states: tuple[Any, Any]) -> None:
        self.path = path
        self.tensors = tensors
        self.versions = versions
        self.attributes = attributes
        self.random_states = random_states
        self.drew = False

    def check_unwritten(self) -> None:
        """Refuse a rerun reading a parameter or buffer written in place since the call ran."""
        for (owner, kind, name, tensor), version in zip(self.tensors, self.versions):
            if version is not None and tensor._version != version:
                what = "parameter" if kind == "_parameters" else "buffer"
                where = self.path or "the model"
                raise RuntimeError(
                    f"optremat: the {what} {name!r} of a {type(owner).__name__} in {where} was written in place "
                    f"between the forward of {where}, which the plan checkpoints, and its rerun in the backward, "
                    "which would compute other values than the forward did. Either the step wrote it (write it "
                    "after the backward, or plan without checkpointing that call), or a module writes it now that "
                    "did not when the plan was made (a BatchNorm planned in eval mode, frozen, and trained after "
                    "model.train(): its forward writes its running statistics); plan again in the modes the "
                    "modules train in")


Tensors = list[tuple[nn.Module, str, str, torch.Tensor]]
"""(module, "_parameters" or "_buffers", name, tensor) for the tensors modules hold."""


def _tensors_of(owners: list[nn.Module], written: set[tuple[int, str]]) -> Tensors:
    """The parameters and buffers of the modules `owners` (the modules a call runs and
    their submodules) as a call starts: those its rerun must read
    (`torch.func.functional_call` puts others in place for the call alone, and has put
    the module's own back by the backward). The buffers the call writes, (id of owner,
    name) in `written`, are left to their copies (`_scratch`): holding one the call
    reassigns would keep its old tensor alive."""
    return [(owner, kind, name, tensor) for owner in owners for kind in ("_parameters", "_buffers")
            for name, tensor in getattr(owner, kind).items()
            if tensor is not None and (kind == "_parameters" or (id(owner), name) not in written)]


def _policy(saved: frozenset[tuple[str, int]]) -> Any:
    """Save the outputs of the ops keyed in `saved`, recompute every other op. The forward
    and a recomputation count occurrences apart, so a PyTorch that asks the policy again
    while recomputing gets the same answers."""
    seen: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        op = str(func).removeprefix("aten.")
        counts = seen[bool(ctx.is_recompute)]
        key = (op, counts[op])
        counts[op] += 1
        return CheckpointPolicy.MUST_SAVE if key in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Rerun:
    """The recomputation's context for one call of a region, entered by every backward
    that reruns it (a first one with `retain_graph=True`, a gradient penalty's): the
    modules hold the tensors they held as the call started (`_swapped`), none of them
    written in place since (`_Found.check_unwritten`), the buffers it writes scratch
    copies (`_scratch`: their copies must not pass through the selective mode, so they
    come first), and the first rerun saves nothing the forward's selective mode saved
    (`recompute`, None for a plain region); later reruns recompute every op, that mode
    having handed its saved outputs to the first (PyTorch's own selective checkpoint
    refuses a second backward). The copies of the buffers as the call started live as
    long as checkpoint holds this context, until the call's autograd nodes are done, as
    plans price them: every rerun reads them. The modules' plain attributes are those
    the call found, and so are those of the plain objects they hold (`restored_plain`):
    `model.eval()`, a schedule's new temperature set before the backward, or a config
    field a head sets on the first call (transformers' `problem_type`) must not change
    what a rerun computes. For a call whose forward drew from numpy's or Python's random
    number generators, they are at the states the call found, and after the rerun as it
    found them: plans never checkpoint a call drawing from them, but one may begin to
    after planning (a noise switched on for training)."""

    def __init__(self, found: _Found, held: list[tuple[nn.Module, str, torch.Tensor]], recompute: Any) -> None:
        self.found = found
        self.held = held
        self.recompute = recompute
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        self.found.check_unwritten()
        self.stack.enter_context(_swapped(self.found.tensors))
        self.stack.enter_context(_scratch(self.held))
        self.stack.enter_context(restored_plain(self.found.attributes))
        self.stack.enter_context(_parametrizations_computed())
        if self.found.drew:
            self.stack.enter_context(host_random_kept(self.found.random_states))
        if self.recompute is not None:
            self.stack.enter_context(self.recompute)
            self.recompute = None

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


@contextlib.contextmanager
def _swapped(tensors: Tensors) -> Iterator[None]:
    """While it lasts, each module holds the tensor `tensors` names for it."""
    replaced = []
    for owner, kind, name, tensor in tensors:
        held = getattr(owner, kind)  # a scripted module's is no dict: no `get`
        current = held[name] if name in held else None
        if current is not tensor:
            replaced.append((owner, kind, name, current))
            getattr(owner, kind)[name] = tensor
    try:
        yield
    finally:
        for owner, kind, name, current in reversed(replaced):
            getattr(owner, kind)[name] = current


@contextlib.contextmanager
def _scratch(held: list[tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    """While a region reruns, each buffer it writes holds a copy of what it held when the
    region first ran: the rerun reads what the forward read, and its writes (in place or
    by reassignment) do not reach the model."""
    real = [owner._buffers[name] for owner, name, _ in held]
    for owner, name, before in held:
        owner._buffers[name] = before.clone()
    try:
        yield
    finally:
        for (owner, name, _), tensor in zip(held, real):
            owner._buffers[name] = tensor
