"""The model's forward as the traced list of aten ops, replayed eagerly under a plan's segments.

Replaying the traced ops instead of the model's Python lets a segment be any contiguous
run of ops, not only a whole module call. Autograd records the replayed ops as it records
the model's own, so the backward, parameter gradients and optimizers work unchanged.

A checkpointed segment runs under `torch.utils.checkpoint` (non-reentrant) with dispatch
modes in the manner of selective checkpointing, keyed by the op being replayed: they save
exactly the outputs the plan keeps and rerun only what the backward needs. Two pieces of
state must not change when a segment is recomputed: random ops replay the generator
state they saw in the forward (even when an earlier random op of the segment is saved
and therefore skipped), and module buffers that ops mutate (BatchNorm running
statistics) are swapped for scratch copies so the recomputation does not update them again.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten
from torch.utils.checkpoint import checkpoint

from optremat.extract import Traced
from optremat.runtime.ops import (autocast_state, call, is_random, mutated_inputs, returns_alias, rng_state,
                                  set_rng_state, signature_of)

@dataclass(frozen=True)
class Segment:
    """Program positions [start, stop). A checkpointed segment keeps the outputs of the ops
    in `saved` for the backward and reruns those in `recomputed` when the backward first
    needs the segment; `saved is None` runs the segment plainly."""

    start: int
    stop: int
    saved: frozenset[str] | None = None
    recomputed: frozenset[str] = frozenset()

    @property
    def checkpointed(self) -> bool:
        return self.saved is not None


class Program:
    """The forward ops of a traced step that produce the model's outputs or update its buffers."""

    def __init__(self, traced: Traced, num_params: int, num_buffers: int, num_inputs: int) -> None:
        gm = traced.module
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.buffers = frozenset(placeholders[num_params:num_params + num_buffers])
        self.inputs = placeholders[:num_params + num_buffers + num_inputs]
        self.signature = signature_of([n.meta.get("val") for n in self.inputs[num_params + num_buffers:]])
        self.autocast = autocast_state()
        self.constants = {n: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        by_name = {n.name: n for n in gm.graph.nodes}
        self.output_spec = traced.output_spec
        self.output_leaves = tuple(by_name.get(leaf, leaf) if isinstance(leaf, str) else leaf
                                   for leaf in traced.output_leaves)
        self.nodes = _needed(gm, self.output_leaves, self.buffers)
        end = len(self.nodes)
        self.last_use: dict[torch.fx.Node, int] = {}
        for i, node in enumerate(self.nodes):
            for p in node.all_input_nodes:
                self.last_use[p] = i
        for leaf in self.output_leaves:
            if isinstance(leaf, torch.fx.Node):
                self.last_use[leaf] = end

    @property
    def fingerprint(self) -> str:
        """A hash of the program's ops and tensor types: equal programs run the same plan."""
        digest = hashlib.sha256()
        for node in self.nodes:
            types = [f"{t.dtype}{list(t.shape)}" for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
            digest.update(f"{node.name}:{node.target}:{','.join(types)}\x1f".encode())
        return digest.hexdigest()[:16]

    @property
    def names(self) -> list[str]:
        """Names of the program's ops in execution order (they match the Graph's node names)."""
        return [n.name for n in self.nodes]

    def run(self, leaves: list[Any], segments: tuple[Segment, ...]) -> Any:
        """Run the forward on flattened (params, buffers, inputs) and rebuild the model's output."""
        resident = dict(zip(self.inputs, leaves))
        resident.update(self.constants)
        env: dict[torch.fx.Node, Any] = {}
        for segment in segments:
            if segment.checkpointed:
                self._checkpointed(segment, resident, env)
            else:
                for i in range(segment.start, segment.stop):
                    node = self.nodes[i]
                    env[node] = call(node, _lookup(resident, env))
                    self._free(env, node.all_input_nodes, i)
        values = [_lookup(resident, env)(leaf) if isinstance(leaf, torch.fx.Node) else leaf
                  for leaf in self.output_leaves]
        return tree_unflatten(values, self.output_spec)

    def _free(self, env: dict, nodes: Any, done: int) -> None:
        for p in nodes:
            if p in env and self.last_use.get(p, -1) <= done:
                del env[p]

    def _checkpointed(self, segment: Segment, resident: dict, env: dict) -> None:
        nodes = self.nodes[segment.start:segment.stop]
        inputs = list(dict.fromkeys(p for n in nodes for p in n.all_input_nodes if p in env))
        outputs = [n for n in nodes if self.last_use.get(n, -1) >= segment.stop]
        kept_local = set(outputs)
        local_last = {p: i for i, n in enumerate(nodes) for p in n.all_input_nodes}
        scratch = {b: resident[b].detach().clone() for n in nodes for b in mutated_inputs(n) if b in self.buffers}
        replay = _Replay({n: _saved_outputs(n, segment.saved) for n in nodes if not returns_alias(n)},
                         {n for n in nodes if n.name in segment.recomputed
                          or (n.name in segment.saved and returns_alias(n))})
        rng_states: dict[torch.fx.Node, Any] = {}

        def run_segment(*values: Any) -> tuple:
            recompute = replay.forward_done
            state = resident | scratch if recompute else resident
            local = dict(zip(inputs, values))
            for i, node in enumerate(nodes):
                if is_random(node):
                    device = tree_leaves(node.meta["val"])[0].device
                    if recompute:
                        set_rng_state(device, rng_states[node])
                    else:
                        rng_states[node] = rng_state(device)
                replay.current = node
                local[node] = call(node, _lookup(state, local))
                if not recompute:
                    replay.keep(node, local[node])
                for p in node.all_input_nodes:
                    if p in local and local_last[p] <= i and p not in kept_local:
                        del local[p]
            replay.current = None
            replay.forward_done = True
            return tuple(local[n] for n in outputs)

        values = checkpoint(run_segment, *(env[p] for p in inputs), use_reentrant=False,
                            context_fn=replay.contexts)
        env.update(zip(outputs, values))
        self._free(env, inputs, segment.stop - 1)


class _Replay:
    """What a checkpointed segment saves and how it is recomputed (in the manner of
    selective checkpointing, but keyed by the op being replayed): the forward stores the
    outputs of saved ops; the recomputation, under a dispatch mode, returns them, reruns
    the recomputed ops, and skips every other op with a zero-stride placeholder, since the
    plan found nothing in the backward needs it."""

    def __init__(self, saved: dict[torch.fx.Node, Any], recomputed: set[torch.fx.Node]) -> None:
        self.saved = {node: which for node, which in saved.items() if which}
        self.recomputed = recomputed
        self.current: torch.fx.Node | None = None
        self.forward_done = False
        self.store: dict[torch.fx.Node, Any] = {}

    def contexts(self) -> tuple[contextlib.nullcontext, TorchDispatchMode]:
        return contextlib.nullcontext(), _Restore(self)

    def keep(self, node: torch.fx.Node, out: Any) -> None:
        """Store the forward's output of `node` (what it saves) for the recomputation."""
        which = self.saved.get(node)
        if which is True:
            self.store[node] = tree_map(_detach, out)
        elif which:
            self.store[node] = tuple(_detach(v) if k in which else None for k, v in enumerate(out))

    def claims(self, func: Any) -> torch.fx.Node | None:
        """The node being replayed if `func` is its op (not an op autograd runs on the side)."""
        node = self.current
        if node is None or func is not node.target:
            return None
        self.current = None
        return node


class _Restore(TorchDispatchMode):
    def __init__(self, replay: _Replay) -> None:
        super().__init__()
        self.replay = replay

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        node = self.replay.claims(func)
        if node is None or node in self.replay.recomputed:
            return func(*args, **(kwargs or {}))
        stored = self.replay.store.pop(node, None)
        if isinstance(stored, tuple) and node in self.replay.saved and self.replay.saved[node] is not True:
            return tuple(_placeholder(v) if s is None else s for s, v in zip(stored, node.meta["val"]))
        if stored is not None:
            return stored
        return tree_map(_placeholder, node.meta["val"])


def _saved_outputs(node: torch.fx.Node, saved: frozenset[str]) -> bool | frozenset[int]:
    """True when the node's whole output is saved; for a multi-output op, the indices of
    the outputs saved (each is a getitem node of its own)."""
    if node.name in saved:
        return True
    return frozenset(user.args[1] for user in node.users
                     if user.target is operator.getitem and user.name in saved)


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _placeholder(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty((), dtype=value.dtype, device=value.device).expand(value.shape)


def _needed(gm: torch.fx.GraphModule, leaves: tuple, buffers: frozenset) -> list[torch.fx.Node]:
    """Forward ops the model's outputs depend on, those that update buffers, and every output
    of a multi-output op among them (the backward may read one), in trace order."""
    forward = [n for n in gm.graph.nodes if n.op == "call_function"
               and n.meta.get("custom", {}).get("optremat_phase") != "backward"]
    roots = [leaf for leaf in leaves if isinstance(leaf, torch.fx.Node)]
    roots += [n for n in forward if any(b in buffers for b in mutated_inputs(n))]
    needed: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in needed and node.op == "call_function":
            needed.add(node)
            stack.extend(node.all_input_nodes)
    parts = {user for node in needed for user in node.users if user.target is operator.getitem}
    return [n for n in forward if n in needed or n in parts]


def _lookup(*scopes: dict) -> Callable[[torch.fx.Node], Any]:
    def value(node: torch.fx.Node) -> Any:
        for scope in scopes:
            if node in scope:
                return scope[node]
        raise KeyError(f"value of {node.name} is not available")
    return value
