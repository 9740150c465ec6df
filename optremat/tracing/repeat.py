"""A model of many alike blocks traced through four of them, the rest copied.

Tracing on fake tensors costs about a millisecond per op, so an 80-layer Llama's step
takes 20 s to trace, while its decoder layers are one computation 80 times. Where a
plain `nn.Sequential`, or a `nn.ModuleList` run by a loop read to run each block once
alike (`LOOPS`), holds at least `MIN_BLOCKS` blocks alike (`alike`: one class, the same
parameters and buffers by name, shape and dtype, the same attributes but for the layer
index transformers' modules hold, no hooks of the user's), the step is traced on a copy
of the model that keeps the first three blocks and the last (`shortened`), and the third
block's forward and backward ops, with its parameters, are copied for each block left
out (`expanded`): a copy reads the copy before it (and its gradient the copy after it)
as the third block read the second (and the last block's gradient).

The copies are made only where the trace shows the second and third blocks alike: the
same ops on the same shapes and costs, reading their neighbours at the same offsets,
their own parameters in the same order and the same tensors from outside the blocks
(the rotary tables, the attention mask). A block read by anything but its neighbours
(a loss over every block's router logits, a weight shared between blocks) leaves the
step to be traced whole. The expanded step is the one the whole model's trace records,
node for node but for the names (tests/test_repeat.py compares them). Hooks a library
installs while the copy runs are taken off the model's modules again (`hooks_kept`).
"""


from __future__ import annotations

import copy
import enum
import functools
import types
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn

from optremat.core.graph import Graph
from optremat.tracing.traced import Traced

MIN_BLOCKS = 6
"""Fewer blocks are traced whole: four are traced either way."""

KEPT = 4
"""Blocks the shortened model keeps: the first three and the last."""

MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
"""The attributes in which a module keeps its hooks."""
_HOOK_FLAGS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")

LOOPS = frozenset({
    "transformers.models.gpt2.modeling_gpt2.GPT2Model",
    "transformers.models.llama.modeling_llama.LlamaModel",
    "transformers.models.mistral.modeling_mistral.MistralModel",
    "transformers.models.mixtral.modeling_mixtral.MixtralModel",
    "transformers.models.qwen2.modeling_qwen2.Qwen2Model",
    "transformers.models.qwen3.modeling_qwen3.Qwen3Model",
    "transformers.models.gemma.modeling_gemma.GemmaModel",
    "optremat.models.GPT",
    "optremat.models.HiddenGPT",
})
"""Classes whose forward (and every method of theirs it may be replaced by on a model)
calls each block of their ModuleList once, in order, with nothing between the calls that
depends on a block's index or the list's length: read in their source. transformers'
decoder stacks run `self.layers[: config.num_hidden_layers]`, picking Qwen's masks by
`config.layer_types[i]`, so they qualify while those are the list's length and one type,
and no hidden states or attentions are collected. A plain Sequential runs its children
so too. Other models' loops (an early exit, an op after layer k, a tensor sized by the
list's length) are not read, and their steps are traced whole."""


class NotAlike(Exception):
    """The traced blocks do not repeat as the copies would need; the step is traced whole."""


def repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """The path and length of `model`'s longest ModuleList or plain Sequential of at least
    `MIN_BLOCKS` blocks alike, run by a loop read to run each once alike (`LOOPS`), or None."""
    owners = {id(child): module for module in model.modules() for child in module.children()}
    found = None
    for path, module in model.named_modules():
        if type(module) in (nn.ModuleList, nn.Sequential) and len(module) >= MIN_BLOCKS \
                and (found is None or len(module) > found[1]) and _looped(module, owners.get(id(module))) \
                and alike(list(module)):
            found = (path, len(module))
    return found


def _looped(blocks: nn.Module, owner: nn.Module | None) -> bool:
    """Whether `blocks` are run by a loop read to run each once alike (`LOOPS`)."""
    if type(blocks) is nn.Sequential:
        return "forward" not in blocks.__dict__
    if owner is None:
        return False
    defining = next(c for c in type(owner).__mro__ if "forward" in vars(c))
    if f"{defining.__module__}.{defining.__qualname__}" not in LOOPS:
        return False
    forward = owner.__dict__.get("forward")
    if forward is not None and not (isinstance(forward, types.MethodType) and forward.__self__ is owner
                                    and forward.__func__ in vars(defining).values()):
        return False
    config = getattr(owner, "config", None)
    if config is None:
        return True
    return (getattr(config, "num_hidden_layers", len(blocks)) == len(blocks)
            and not getattr(config, "output_hidden_states", False) and not getattr(config, "output_attentions", False)
            and len(set(getattr(config, "layer_types", None) or [None])) == 1)


@contextmanager
def hooks_kept(model: nn.Module) -> Iterator[None]:
    """While it lasts, hooks that something installs on `model`'s modules are removed when
    it ends: transformers installs its output-capturing hooks on the modules of the first
    model object it runs and marks that object, so a trace of a copy would leave the
    model itself to install them a second time."""
    before = {id(m): {h: set(getattr(m, h, {})) for h in MODULE_HOOKS} for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            for h in MODULE_HOOKS:
                hooks = getattr(m, h, {})
                for key in set(hooks) - before.get(id(m), {}).get(h, set()):
                    del hooks[key]
                    for flags in _HOOK_FLAGS:
                        getattr(m, flags, {}).pop(key, None)


def alike(blocks: list[nn.Module]) -> bool:
    """Whether `blocks` are distinct modules computing alike: per submodule the same class,
    the same attributes (`_value`: plain ones equal, but for the `layer_idx` of
    transformers' own modules, which read it only to index a cache; a block's method by
    its function, other objects by identity), no hooks but transformers' own
    output-capturing ones, and the same parameters and buffers by name, shape, dtype and
    device, none shared. What a block's code does with an attribute is not read, so
    blocks of other classes must hold equal ones: a block of index 4 that branches on it
    runs other ops than the copy of the third block."""
    tensors = [id(t) for b in blocks for _, t in [*b.named_parameters(remove_duplicate=False),
                                                  *b.named_buffers(remove_duplicate=False)]]
    if len({id(b) for b in blocks}) < len(blocks) or len(set(tensors)) < len(tensors):
        return False
    if any(not _capturing(hook) for b in blocks for m in b.modules() for h in MODULE_HOOKS
           for hook in getattr(m, h, {}).values()):
        return False
    facts = [_facts(b) for b in blocks]
    if any(f[0] != facts[0][0] for f in facts):
        return False
    indexed = [k in INDICES and type(m).__module__.startswith("transformers.")
               for m in blocks[0].modules() for k, _ in _attributes(m)]
    return all(len(set(column)) == 1 or (index and list(column) == list(range(len(blocks))))
               for column, index in zip(zip(*(f[1] for f in facts)), indexed))


INDICES = ("layer_idx",)
"""The attributes transformers' modules hold their layer's index in, read only to index
the key/value cache (their attention type is another attribute, compared)."""


def _capturing(hook: Any) -> bool:
    """Whether `hook` is one of transformers' output-capturing hooks, which record a
    module's output only where the call asks for hidden states or attentions."""
    return getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


def _facts(block: nn.Module) -> tuple[tuple, tuple]:
    """What must match between blocks, and their attributes' values (`_value`) by module
    and name."""
    modules = tuple((name, type(m), tuple(len(getattr(m, h, ())) for h in MODULE_HOOKS))
                    for name, m in block.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
                    for name, t in [*block.named_parameters(), *block.named_buffers()])
    attributes = tuple((name, k, _value(v, m)) for name, m in block.named_modules() for k, v in _attributes(m))
    return (modules, tensors, tuple(key[:2] for key in attributes)), tuple(v for *_, v in attributes)


def _attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """`module`'s public attributes by name; an installed plan's forward (which steps
    aside while a step is traced) as the forward it replaced, and left out where that is
    the class's own."""
    for key, value in sorted(vars(module).items()):
        if key.startswith("_"):
            continue
        if getattr(value, "steps_aside_while_tracing", False):
            value = value.replaced
            if key == "forward" and isinstance(value, types.MethodType) and value.__self__ is module \
                    and value.__func__ is type(module).forward:
                continue
        if key == "kwargs" and isinstance(value, dict) and type(module).__module__.startswith("peft.tuners."):
            value = {k: v for k, v in value.items() if k != "target_name"}  # peft's layers keep their path there
        yield key, value


def _value(value: Any, module: nn.Module) -> Any:
    """An attribute of `module` as blocks must share it: a plain value (numbers, strings,
    dtypes, devices, None) itself, tuples, lists, sets and dicts by their items, a
    partial by its function and arguments (transformers' GELU holds one per module), a
    method of the module its function, an enum member itself, a tensor its shape, dtype
    and device, any other object its identity."""
    if isinstance(value, (tuple, list)):
        return tuple(_value(v, module) for v in value)
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_value(v, module)) for v in value)))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _value(v, module)) for k, v in value.items())))
    if isinstance(value, functools.partial):
        return ("partial", _value(value.func, module), _value(value.args, module), _value(value.keywords, module))
    if isinstance(value, torch.device):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum)):
        return value
    if isinstance(value, types.MethodType) and value.__self__ is module:
        return ("method", value.__func__)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, str(value.device))
    return ("object", id(value))


def shortened(model: nn.Module, path: str) -> nn.Module:
    """A copy of `model` sharing its modules and tensors whose blocks at `path` are the
    first three and the last; `model` is not changed. Raises NotAlike where a module on
    the way to the blocks has a forward set on it that the copy cannot run on itself."""
    parts = path.split(".") if path else []

    def copied(module: nn.Module, depth: int) -> nn.Module:
        clone = copy.copy(module)
        clone.__dict__["_modules"] = dict(module._modules)
        if "forward" in module.__dict__:
            clone.__dict__["forward"] = _rebound(module.__dict__["forward"], module, clone)
        if depth == len(parts):
            kept = [module[i] for i in (*range(KEPT - 1), len(module) - 1)]
            clone.__dict__["_modules"] = {str(k): block for k, block in enumerate(kept)}
        else:
            clone._modules[parts[depth]] = copied(module._modules[parts[depth]], depth + 1)
        return clone

    return copied(model, 0)


def _rebound(forward: Any, module: nn.Module, clone: nn.Module) -> Any:
    """A forward set on `module` (a method of it, or a partial over it such as
    `causal_lm.running`'s) made to run on `clone`."""
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        return types.MethodType(forward.__func__, clone)
    if isinstance(forward, functools.partial):
        args = [clone if a is module else _rebound(a, module, clone)
                if isinstance(a, (types.MethodType, functools.partial)) else a for a in forward.args]
        return functools.partial(forward.func, *args, **forward.keywords)
    raise NotAlike(f"a forward set on the module ({type(forward).__name__}) that a copy cannot run on itself")


@dataclass(frozen=True)
class Layout:
    """Where the short step's blocks lie: each block's forward and backward segment (the
    ops from the block's first up to the next block's first, the last block's forward up
    to its own last op, the first block's backward up to its last; `NO_SPAN` for none),
    and its placeholders."""

    forward: tuple[tuple[int, int], ...]
    backward: tuple[tuple[int, int], ...]
    places: tuple[tuple[int, ...], ...]

    def block_of(self, v: int) -> int | None:
        for i in range(KEPT):
            if _within(v, self.forward[i]) or _within(v, self.backward[i]) or v in self.places[i]:
                return i
        return None


NO_SPAN = (-1, -1)
"""A segment of no ops (a loop of the forward alone has no backward segments)."""


def _within(v: int, span: tuple[int, int]) -> bool:
    return span[0] <= v < span[1]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _block_path(path: str, i: int) -> str:
    return f"{path}.{i}" if path else str(i)


def _layout(traced: Traced, names: list[str], path: str) -> Layout:
    graph = traced.graph
    prefixes = [_block_path(path, i) for i in range(KEPT)]
    forward_ops = [[v for v, stack in enumerate(traced.calls) if any(p == prefix for p, _ in stack)]
                   for prefix in prefixes]
    backward_ops = [[v for v in np.flatnonzero(graph.backward) if _under(graph.module[v], prefix)]
                    for prefix in prefixes]
    if not all(forward_ops) or not all(backward_ops):
        raise NotAlike("a block runs no op in the forward or the backward")
    starts = [ops[0] for ops in forward_ops] + [forward_ops[-1][-1] + 1]
    back = [ops[0] for ops in backward_ops]
    back_ends = [backward_ops[0][-1] + 1] + back[:-1]
    if starts != sorted(set(starts)) or back != sorted(set(back), reverse=True) or back[-1] < starts[-1]:
        raise NotAlike("the blocks' ops do not follow each other in the step")
    places = tuple(tuple(k for k, name in enumerate(names) if _under(name, prefix)) for prefix in prefixes)
    return Layout(tuple(zip(starts[:-1], starts[1:])), tuple(zip(back, back_ends)), places)


def signature(traced: Traced, layout: Layout, i: int, path: str | None) -> list[tuple]:
    """Block i's nodes as the copies depend on them: their own facts and, for each node
    read, where it lies relative to block i (its own or a neighbour's segment, its
    placeholders, or a node outside every block); module paths under the block at `path`
    relative to it (None: segments of no module of their own, as is)."""
    graph, (f0, f1), (b0, b1) = traced.graph, layout.forward[i], layout.backward[i]
    place = {v: k for k, v in enumerate(layout.places[i])}
    f_lo, f_hi = layout.forward[i - 1][0], layout.forward[i + 1][1]
    b_lo, b_hi = layout.backward[i + 1][0], layout.backward[i - 1][1]
    prefix = None if path is None else _block_path(path, i)

    def ref(t: int) -> tuple:
        if t < 0:
            return ()
        if f_lo <= t < f_hi:
            return ("forward", t - f0)
        if b_lo <= t < b_hi:
            return ("backward", t - b0)
        if t in place:
            return ("place", place[t])
        return ("outside", t) if layout.block_of(t) is None else ("block", t)

    def named(name: str) -> str:
        return "*" + name[len(prefix):] if prefix is not None and _under(name, prefix) else name

    preds = graph.pred_lists
    return [(graph.ops[v], int(graph.size[v]), float(graph.cost[v]), bool(graph.backward[v]), graph.kind[v],
             named(graph.module[v]), graph.tensor[v], bool(graph.fusible[v]), int(graph.workspace[v]),
             bool(graph.output[v]), traced.random[v], ref(int(graph.alias_of[v])), ref(int(traced.grad_of[v])),
             ref(int(graph.lives_to[v])), tuple(sorted(ref(p) for p in preds[v])),
             tuple((named(p), k) for p, k in traced.calls[v]))
            for v in [*range(f0, f1), *range(b0, b1), *layout.places[i]]]


def expanded(traced: Traced, short: nn.Module, model: nn.Module, path: str, n: int) -> Traced:
    """The step of `model`, whose `n` blocks at `path` are alike, from `traced`, the step of
    `short` (`shortened(model, path)`). Raises NotAlike where the short step's second and
    third blocks do not repeat as the copies need."""
    names = [*dict(short.named_parameters()), *dict(short.named_buffers())]
    layout = _layout(traced, names, path)
    if signature(traced, layout, 1, path) != signature(traced, layout, 2, path):
        raise NotAlike("the second and third blocks differ")
    copies = Copies(traced, layout, path, n)
    graph = copies.graph()
    full = [*dict(model.named_parameters()), *dict(model.named_buffers())]
    if int(np.sum(np.array(graph.kind) == "param")) != len(full):
        raise NotAlike("the copied parameters are not the model's")
    gradients = dict(zip(traced.gradients, traced.gradient_nodes))
    named = [(name, copies.short_name(name)) for name, p in model.named_parameters() if p.requires_grad]
    kept = [(name, copies.at[(gradients[short_name], j)]) for name, (short_name, j) in named
            if short_name in gradients]
    mutated = tuple(sorted(name for name in full if copies.short_name(name)[0] in traced.mutated_buffers))
    return replace(traced, graph=graph, grad_of=copies.column(traced.grad_of),
                   gradients=tuple(name for name, _ in kept), gradient_nodes=tuple(k for _, k in kept),
                   calls=tuple(copies.calls(traced.calls[v], j) for v, j in copies.order),
                   cached_calls=copies.calls_among(traced.cached_calls, traced.calls),
                   generator_calls=copies.calls_among(traced.generator_calls, traced.calls),
                   stateful_calls=copies.calls_among(traced.stateful_calls, traced.calls),
                   random=tuple(traced.random[v] for v, _ in copies.order), mutated_buffers=mutated)


class Copies:
    """The expanded step's nodes in order, each a short step's node and the block index it
    is copied for (None: the node itself), and how each node read maps into it; module
    paths under the blocks at `path` renamed for each copy (None: kept)."""

    def __init__(self, traced: Traced, layout: Layout, path: str | None, n: int) -> None:
        self.traced, self.layout, self.path, self.n = traced, layout, path, n
        self.middle = range(2, n - 1)
        (f0, f1), (b0, b1) = layout.forward[2], layout.backward[2]
        self.length = (f1 - f0, b1 - b0)
        runs = _runs(layout.places[2])
        order: list[tuple[int, int | None]] = []
        v = 0
        while v < traced.graph.n:
            if v == f0:
                order += [(u, j) for j in self.middle for u in range(f0, f1)]
                v = f1
            elif v == b0:
                order += [(u, j) for j in reversed(self.middle) for u in range(b0, b1)]
                v = b1
            elif v in runs:
                order += [(u, j) for j in self.middle for u in runs[v]]
                v = runs[v][-1] + 1
            else:
                order.append((v, None))
                v += 1
        self.order = order
        self.at = _Positions({key: k for k, key in enumerate(order)})

    def resolve(self, v: int, j: int | None, t: int) -> int:
        """The expanded index of node `t` as read by the copy of `v` for block `j`."""
        if t < 0:
            return -1
        forward, backward = self.layout.forward, self.layout.backward
        template = _within(t, forward[2]) or _within(t, backward[2]) or t in self.layout.places[2]
        if j is None:
            if not template:
                return self.at[(t, None)]
            block = self.layout.block_of(v)
            later = v > t
            if block == 1 and later == _within(t, backward[2]):
                return self.at[(t, 2)]
            if block == KEPT - 1 and later == _within(t, forward[2]):
                return self.at[(t, self.n - 2)]
            raise NotAlike("a node outside the neighbouring blocks reads the third block")
        if template:
            return self.at[(t, j)]
        length, back_length = self.length
        for span, shift, step in ((forward[1], length, -1), (forward[3], -length, 1),
                                  (backward[3], back_length, 1), (backward[1], -back_length, -1)):
            if _within(t, span):
                neighbour = j + step
                if neighbour not in self.middle:
                    return self.at[(t, None)]
                moved = t + shift
                if not (_within(moved, forward[2]) or _within(moved, backward[2])):
                    raise NotAlike("a copy reads past its neighbour's segment")
                return self.at[(moved, neighbour)]
        if self.layout.block_of(t) is not None:
            raise NotAlike("the third block reads a block other than its neighbours")
        return self.at[(t, None)]

    def column(self, values: np.ndarray) -> np.ndarray:
        return np.array([self.resolve(v, j, int(values[v])) for v, j in self.order], dtype=np.int64)

    def renamed(self, name: str, j: int | None) -> str:
        """A module path of the short step as block `j`'s copy (or the node itself) names it."""
        if self.path is None:
            return name
        block = 2 if j is not None else KEPT - 1
        prefix = _block_path(self.path, block)
        if not _under(name, prefix):
            return name
        return _block_path(self.path, j if j is not None else self.n - 1) + name[len(prefix):]

    def short_name(self, name: str) -> tuple[str, int | None]:
        """The short model's name for a parameter or buffer of the model, and the block
        whose copy it is (None: the short step's own)."""
        head = _block_path(self.path, 0)[:-1]
        if not name.startswith(head):
            return name, None
        index, dot, rest = name[len(head):].partition(".")
        if not index.isdigit() or not dot:
            return name, None
        i = int(index)
        if i in self.middle:
            return _block_path(self.path, 2) + "." + rest, i
        return (_block_path(self.path, KEPT - 1) + "." + rest if i == self.n - 1 else name), None

    def calls(self, stack: tuple[tuple[str, int], ...], j: int | None) -> tuple[tuple[str, int], ...]:
        return tuple((self.renamed(p, j), k) for p, k in stack)

    def calls_among(self, chosen: frozenset[tuple[str, int]], stacks: tuple[tuple[tuple[str, int], ...], ...]
                    ) -> frozenset[tuple[str, int]]:
        """The calls of the expanded step that are copies of the short step's `chosen`
        (each node's call stack in `stacks`)."""
        return frozenset(renamed for v, j in self.order for renamed, call in zip(self.calls(stacks[v], j), stacks[v])
                         if call in chosen)

    def graph(self) -> Graph:
        g = self.traced.graph
        edges = [(self.resolve(d, j, s), self.at[(d, j)]) for d, j in self.order for s in g.pred_lists[d]]
        pick = lambda column: [column[v] for v, _ in self.order]  # noqa: E731
        lives_to = self.column(g.lives_to)
        return Graph.build(
            names=[g.names[v] if j is None else f"{g.names[v]}_{j}" for v, j in self.order],
            ops=pick(g.ops), cost=pick(g.cost), size=pick(g.size), backward=pick(g.backward), kind=pick(g.kind),
            module=[self.renamed(g.module[v], j) for v, j in self.order], alias_of=self.column(g.alias_of),
            output=pick(g.output), fusible=pick(g.fusible), workspace=pick(g.workspace), tensor=pick(g.tensor),
            edges=edges, lives_to=np.where(lives_to > np.arange(len(self.order)), lives_to, -1))


class _Positions(dict):
    """Expanded indices by (short node, copy); a node the copies do not hold is NotAlike."""

    def __missing__(self, key: tuple[int, int | None]) -> int:
        raise NotAlike(f"node {key[0]} is read as block {key[1]}'s, which holds no copy of it")


def _runs(places: tuple[int, ...]) -> dict[int, list[int]]:
    """The consecutive runs of `places`, by their first node."""
    runs: dict[int, list[int]] = {}
    run: list[int] = []
    for v in places:
        if not run or v != run[-1] + 1:
            run = runs[v] = []
        run.append(v)
    return runs
