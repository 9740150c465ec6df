"""nn.Module + example inputs → Graph of one training step.

The step is traced with `make_fx` on fake tensors (no real memory is touched) as
`torch.autograd.grad` of the loss with respect to every parameter, which records the
backward ops autograd really runs: a backward op reads exactly the forward tensors that
autograd saved for it. Without a loss function, the gradient of the model's output is
an input of the step, so any loss computed outside the model is covered. A loss over
the model's own parameters (an `optremat.CausalLMLoss` over its LM head) reads them as
the traced step's, and PyTorch's chunked `linear_cross_entropy` is recorded op by op
(`chunked.DECOMPOSITIONS`), so that its chunks' logits are priced.
"""

from __future__ import annotations

import operator
import os
import random
import re
import sys
import threading
import warnings
from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils.checkpoint
from torch._dynamo.eval_frame import OptimizedModule
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from optremat.core.graph import Graph
from optremat.core.schedule import keep_all, simulate
from optremat.tracing import module_state
from optremat.tracing.chunk_copies import chunks_expanded
from optremat.tracing.chunked import DECOMPOSITIONS, loops_shortened
from optremat.tracing.costs import (COST_MODELS, DeviceProfile, UnboundedSize, concrete, device_profile, profile_costs,
                                    roofline_cost, runs_on_cpu, storage_bytes, workspace_bytes)
from optremat.tracing.eager_branches import EagerScalarReads, eager_mask_decisions, writes_in_place
from optremat.tracing.inputs import Call, call_of, differentiated, own_loss
from optremat.tracing.kv_cache import cache_tensors, is_cache, receives_cache
from optremat.tracing.leaks import swept, traced_in
from optremat.tracing.lm_loss import standing_in
from optremat.tracing.onednn import size_matmul_scratch, size_rnn_workspaces
from optremat.tracing.repeat import expanded, hooks_kept, repeated_blocks, shortened
from optremat.tracing.traced import Traced


class ExtractionError(RuntimeError):
    """The model could not be traced; the message names the op and module and what to try."""


_MARK = "optremat"
_TRACING = threading.local()
"""How many traces the current thread has under way: a trace runs the model on the thread
that asked for it, so models other threads run meanwhile keep their plans."""


def tracing() -> bool:
    """Whether this thread is tracing a step: an installed plan steps aside meanwhile, so a
    model is traced as it is, whether or not a plan is on it."""
    return getattr(_TRACING, "depth", 0) > 0


@contextmanager
def _tracing() -> Iterator[None]:
    _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _TRACING.depth -= 1


@swept
def extract(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    cost_model: str = "roofline",
    device: str | DeviceProfile = "cpu",
) -> Graph:
    """The joint forward+backward Graph of one training step of `model`.

    `cost_model="roofline"` prices ops from FLOPs and bytes over `device`'s profile;
    `cost_model="profile"` runs the step on the model's real tensors and times each op.
    """
    return trace(model, example_inputs, loss_fn, cost_model=cost_model, device=device).graph


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    cost_model: str = "roofline",
    device: str | DeviceProfile = "cpu",
) -> Traced:
    """Like `extract`, also returning the fx graph traced. With the roofline, a model of
    many alike blocks is traced through four of them and the rest copied
    (`tracing.repeat`), and an LM head's chunk loop through five chunks
    (`tracing.chunk_copies`), where the trace shows they repeat; else, and with timed
    costs (each op run), the whole step is traced. The step traced is the training step whatever
    mode the caller runs in: gradients on, inference mode and anomaly detection off (under
    `no_grad` no backward was traced; anomaly mode's check of every gradient for NaNs reads
    values a trace does not have)."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"cost_model must be one of {', '.join(map(repr, COST_MODELS))}, not {cost_model!r}")
    with torch.enable_grad(), torch.inference_mode(False), torch.autograd.set_detect_anomaly(False):
        if cost_model == "roofline":
            try:
                copied = _through_four_blocks(model, example_inputs, loss_fn, device)
            except Exception:  # noqa: BLE001 - NotAlike, or a model that runs only whole: its whole trace decides
                copied = None
            if copied is not None:
                return copied
            return _through_five_chunks(model, example_inputs, loss_fn, device)
        return _trace(model, example_inputs, loss_fn, cost_model, device)


def _through_four_blocks(model: nn.Module, example_inputs: Sequence[Any] | Any,
                         loss_fn: Callable[[Any], torch.Tensor] | None, device: str | DeviceProfile) -> Traced | None:
    """The step of a model of many alike blocks traced through four of them (`tracing.repeat`),
    or None for a model without them."""
    blocks = repeated_blocks(model)
    kwargs = call_of(example_inputs)[1]
    if blocks is None or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        return None
    short = shortened(model, blocks[0])
    with hooks_kept(model):
        traced = _through_five_chunks(short, example_inputs, loss_fn, device)
    return expanded(traced, short, model, *blocks)


def _through_five_chunks(model: nn.Module, example_inputs: Sequence[Any] | Any,
                         loss_fn: Callable[[Any], torch.Tensor] | None, device: str | DeviceProfile) -> Traced:
    """The step, priced by the roofline, with an LM head's chunk loop traced through five
    chunks and the rest copied (`tracing.chunk_copies`); traced whole where the chunks
    traced do not repeat, or the shortened loop fails."""
    try:
        with loops_shortened(_mark_chunk):
            traced = _trace(model, example_inputs, loss_fn, "roofline", device)
        by_name = {node.name: node for node in traced.module.graph.nodes}
        marks = [by_name[name].meta.get("custom", {}).get(f"{_MARK}_chunk") for name in traced.graph.names]
        return chunks_expanded(traced, marks)
    except Exception:  # noqa: BLE001 - NotAlike, or a loop that runs only whole: its whole trace decides
        return _trace(model, example_inputs, loss_fn, "roofline", device)


def _mark_chunk(chunk: int | None) -> None:
    """Mark the ops a trace records next as chunk `chunk`'s (None: outside the loop); a
    forward run outside a trace (for its outputs' shapes) marks nothing."""
    if fx_traceback.has_preserved_node_meta():
        _set_custom(chunk=chunk)


def _trace(model: nn.Module, example_inputs: Sequence[Any] | Any, loss_fn: Callable[[Any], torch.Tensor] | None,
           cost_model: str, device: str | DeviceProfile) -> Traced:
    try:
        inputs = call_of(example_inputs)
    except TypeError as error:
        raise ExtractionError(str(error)) from None
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [name for name, p in params.items() if p.requires_grad]
    if not trainable and not differentiated(inputs):
        raise ExtractionError(f"{type(model).__name__} has no parameter that requires grad, and no input does: there "
                              "is no backward to plan")
    lazy = [name for name, t in (*params.items(), *buffers.items()) if nn.parameter.is_lazy(t)]
    if lazy:
        raise ExtractionError(f"{type(model).__name__}'s '{lazy[0]}' is not initialized yet (a lazy module's): run "
                              "the model once on a batch before planning, so that its shapes are known")
    sparse = [path for path, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ExtractionError(f"module '{sparse[0]}' makes a sparse gradient (sparse=True), which optremat does not "
                              "price: build it with sparse=False")

    with module_state.kept(model), _grouped_mm_in_any_float():
        try:
            grad_shapes = None if loss_fn is not None else _output_like(model, params, buffers, inputs)
        except Exception as error:  # noqa: BLE001 - rewrapped with what it failed on
            raise ExtractionError(_explain_failure(model, error, "")) from error

    structure: dict[str, Any] = {}
    identity = {name: id(p) for name, p in params.items()}

    def read() -> None:  # a call branching on a value its example batch decided is not checkpointed
        reading.update(stack[1:])
        places.add(stack[-1][0] or f"{type(model).__name__}.forward")

    def step(params: dict, buffers: dict, inputs: Call, grad_outputs: list) -> tuple:
        traced_in(detect_fake_mode(tree_leaves((params, buffers, inputs))))  # before the forward caches anything
        with EagerScalarReads(leaves, read):
            out, structure["reassigned"] = _call(model, params, buffers, inputs)
            attributes = _set_by_forward(model)
            if loss_fn is not None:
                with standing_in({identity[name]: t for name, t in params.items()}):
                    roots, root_grads = [_scalar_loss(loss_fn(out))], None
            else:
                roots, root_grads = _grad_leaves(out), grad_outputs
        wanted = differentiated(inputs)
        with _phase("backward"), _tag_grad_fns(roots, python, on_ctx, (params, buffers, inputs)):
            seeds = _seeds(roots) if root_grads is None else []
            grads = torch.autograd.grad(roots, [params[k] for k in trainable] + wanted, root_grads or seeds,
                                        allow_unused=True)
        grads, input_grads = grads[:len(trainable)], [g for g in grads[len(trainable):] if g is not None]
        structure["gradients"] = tuple(k for k, g in zip(trainable, grads) if g is not None)
        structure["input gradients"] = len(input_grads)
        return (roots, _held(out) + attributes + [s for s in seeds if s is not None] + input_grads,
                [g for g in grads if g is not None])

    grad_outputs = [] if grad_shapes is None else [torch.empty_like(t) for t in grad_shapes]
    args = (params, buffers, inputs, grad_outputs)
    leaves = tree_leaves(args)
    cached: set[tuple[str, int]] = set()
    host_drawing: set[tuple[str, int]] = set()
    stateful: set[tuple[str, int]] = set()
    reading: set[tuple[str, int]] = set()
    places: set[str] = set()
    python: set[int] = set()
    on_ctx: set[int] = set()
    with module_state.kept(model), _tracing(), host_random_kept(), _reentrant_checkpoint_refused(), \
            _grouped_mm_in_any_float(), eager_mask_decisions(leaves), \
            _module_paths(model, cached, host_drawing, stateful) as stack, _python_holds(model) as holds, \
            fx_traceback.preserve_node_meta():
        host_random = host_random_states()
        try:
            gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True,
                         decomposition_table=DECOMPOSITIONS)(*args)
        except ExtractionError:
            raise
        except Exception as error:  # noqa: BLE001 - rewrapped with the op and module it failed in
            raise ExtractionError(_explain_failure(model, error, stack[-1][0])) from error
        drew = not same_host_random(host_random, host_random_states())
    _refuse_mixed_products(model, gm)
    if drew:
        named = sorted({path for path, _ in host_drawing}) or [f"{type(model).__name__}.forward"]
        warnings.warn(f"optremat: the step draws from Python's or numpy's random numbers (in {', '.join(named)}), "
                      "so its plan is priced for the numbers the trace drew: where they choose which modules run "
                      "or how large tensors are (a layer drop), a step drawing others runs another step than the "
                      "one planned, and can peak above it (the calls drawing them are not checkpointed)",
                      stacklevel=3)
    size_rnn_workspaces(gm)
    if places:
        warnings.warn(f"optremat: the step reads tensor values as numbers (in {', '.join(sorted(places))}), so its "
                      "plan is priced for the example batch's values and the branches and sizes they choose; a "
                      "batch whose values choose others runs another step than the one planned (the calls reading "
                      "them are not checkpointed)", stacklevel=3)
    stateful.update(reading)
    if not structure["gradients"] and not structure["input gradients"]:
        raise ExtractionError(f"the step's loss does not depend on any parameter of {type(model).__name__} or input "
                              "that requires grad: there is no backward to plan; check that loss_fn uses the model's "
                              "output")

    placeholder_kinds = (["param"] * len(params) + ["param"] * len(buffers)
                         + ["input"] * len(tree_leaves(inputs)) + ["input"] * len(grad_outputs))
    param_names = list(params) + list(buffers)
    profile = device_profile(device)
    results = tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    fx_nodes = [n for n in gm.graph.nodes if n.op != "output"]
    # make_fx lists placeholders first, but constants (get_attr) can come later: hoist them.
    fx_nodes.sort(key=lambda n: 0 if n.op in ("placeholder", "get_attr") else 1)
    try:
        costs = _costs(gm, args, cost_model, profile)
        graph = to_graph(fx_nodes, placeholder_kinds, param_names, costs, results,
                         lambda node: node.meta.get("custom", {}).get(f"{_MARK}_phase") == "backward",
                         accumulated_in_place(gm), cpu=runs_on_cpu(profile))
    except UnboundedSize as error:
        raise ExtractionError(f"{type(model).__name__}'s step cannot be priced: {error}, so no memory price "
                              "holds for every batch") from None
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[name] for name in graph.names]
    calls = tuple(_call_stack(node) if kind == "op" and not backward else ()
                  for node, kind, backward in zip(nodes, graph.kind, graph.backward.tolist()))
    random = tuple(torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) for node in nodes)
    drawing = frozenset(call for node, stack in zip(nodes, calls) if node.kwargs.get("generator") is not None
                        for call in stack) | host_drawing
    # a tensor attribute written in place (a running statistic that is not a buffer) is one
    # more piece of state a rerun would write again
    stateful.update(call for node, stack in zip(nodes, calls)
                    if any(_viewed(p).op == "get_attr" for p in mutated_inputs(node)) for call in stack)
    # an autograd.Function keeping tensors on its ctx holds them through any checkpoint around it
    stateful.update(call for node, stack in zip(nodes, calls) if node.meta.get("seq_nr") in on_ctx
                    for call in stack)
    index = {name: i for i, name in enumerate(graph.names)}
    gradient_nodes = tuple(index[node.name] for node in results[len(results) - len(structure["gradients"]):])
    grad_of = _grad_of(gm, graph)
    formulas = _formulas(gm, index)
    graph = replace(graph, module=tuple(graph.module[int(f)] if f >= 0 and graph.module[int(f)] else m
                                        for m, f in zip(graph.module, grad_of)),
                    lives_to=_lives_to(graph, holds, index, formulas, python, calls),
                    edges=_formula_reads(graph, formulas, gm, grad_of),
                    size=_constants_once(gm, graph, index, tree_leaves(args)))
    mutated = tuple(sorted(set(_mutated_buffers(gm, list(params), list(buffers))) | structure["reassigned"]))
    return Traced(gm, graph, grad_of, structure["gradients"], calls, random, mutated, gradient_nodes,
                  frozenset(cached), drawing, frozenset(stateful))


class LossPrice(NamedTuple):
    """What a loss run by eager autograd on a model's output holds at its peak beyond the
    output (`bytes`), what its forward and backward cost (`cost`, seconds), and the bytes
    of the gradients it gives tensors other than the output (`gradients`: a head's weight
    it reads, whose gradient autograd holds from the loss's backward to the step's end),
    and those tensors (`outside`), resident through the step wherever they are not also
    inputs of the step priced with the loss."""

    bytes: int
    cost: float
    gradients: int
    outside: tuple[torch.Tensor, ...] = ()


class LossNotApplicable(ValueError):
    """A loss function that fails on the outputs it was to be priced on."""


def output_loss_price(out: Any, loss_fn: Callable[[Any], torch.Tensor], *, device: str | DeviceProfile = "cpu",
                      cost_model: str = "roofline") -> LossPrice:
    """The price of a loss computed by eager autograd on a model output like `out`
    (tensors, real or fake, whose `requires_grad` says which take a gradient): the bytes
    it holds at its peak beyond the output, which the caller holds through the backward
    (`out = model(x)`; the output's gradient counts as the loss's own), and its cost.
    LossNotApplicable where `loss_fn` fails on `out`."""
    try:
        outside = _outside_leaves(out, loss_fn)
    except Exception as error:  # noqa: BLE001 - the caller's loss, on outputs it may not take
        raise LossNotApplicable(f"{type(error).__name__}: {str(error).strip().splitlines()[0]}") from error
    graph = _ended(trace(_Output(out, outside), (), loss_fn, device=device, cost_model=cost_model).graph)
    held = np.unique(graph.storage_root[graph.pinned])
    return LossPrice(max(simulate(graph, keep_all(graph)).peak_bytes - int(graph.unit_size[held].sum()), 0),
                     graph.total_cost, sum(t.numel() * t.element_size() for t in outside), outside)


def _ended(graph: Graph) -> Graph:
    """`graph` and after its last node one that does nothing. A tensor is held into the
    stage after its `lives_to` (`Graph.held_until`), which past the last node does not
    exist: the temporaries of a backward formula ending the graph (`y.square()`'s:
    `grad * (2 * y.pow(1))`, each held until the product returns) were dropped before
    its last op, and a loss's price fell one output short of what eager holds."""
    return graph.with_node(graph.n, name="end", op="end", kind="op", size=0, backward=True, output=False)


def _outside_leaves(out: Any, loss_fn: Callable[[Any], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The leaf tensors outside `out` that `loss_fn` on `out` gives gradients (the autograd
    graph's accumulators of tensors it closes over: the tensors themselves), found on
    fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, out)
        loss = loss_fn(fake)
    own = {id(t) for t in tree_leaves(fake)}
    seen, stack, outside = set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor) and id(leaf) not in own:
            outside[id(leaf)] = leaf
        stack.extend(fn for fn, _ in node.next_functions)
    return tuple(outside.values())


def assumed_loss(out: Any) -> torch.Tensor:
    """The loss a plan prices when none is given: a cross-entropy over the last dimension
    of the output's largest floating-point tensor, as a language model's or classifier's
    loss is computed after the model. A tensor of three or more dimensions is read as a
    causal language model's logits and its loss as commonly written after the model,
    `cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))`: shifted
    one position along dim -2 and flattened (a copy), in float32 (another copy of
    lower-precision logits); a 2-D one as a classifier's. It holds those copies, a
    log-softmax and two gradients of their size; the model's output itself is priced as
    held through the backward. Only the price depends on it: any loss trains under the
    plan."""
    leaves = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.requires_grad]
    if not leaves:
        raise ExtractionError("the model's output has no tensor that requires grad; pass loss_fn or check the model")
    logits = max(leaves, key=lambda t: t.numel())
    if logits.dim() >= 3 and logits.shape[-2] > 1:
        logits = logits[..., :-1, :]
    flat = logits.reshape(-1, logits.shape[-1]) if logits.dim() > 1 else logits.reshape(1, -1)
    target = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return nn.functional.cross_entropy(flat.float(), target)


class DefaultLoss:
    """The loss planned when none is given: the model's own where its output carries one
    (`outputs.loss` of a transformers model given `labels`, see `inputs.own_loss`), else
    `assumed_loss`; after a trace `source` says which ("own" or "assumed")."""

    def __init__(self) -> None:
        self.source = ""

    def __call__(self, out: Any) -> torch.Tensor:
        own = own_loss(out)
        self.source = "assumed" if own is None else "own"
        return assumed_loss(out) if own is None else own


class _Output(nn.Module):
    """A module with no inputs returning tensors shaped like a model's output, those
    that take a gradient as parameters, so that tracing a loss over it is a training step.
    The parameters the loss reads outside the output (`outside`: an LM head's weight) are
    its parameters too, so that their gradients are traced and priced with the loss (a
    CausalLMLoss reads its head as the traced tensor standing for it, `standing_in`):
    without them the whole head's loss was priced without its weight's gradient product,
    which the chunked head's computes in its forward, and a plan chose the whole head
    where its chunks cost less."""

    def __init__(self, out: Any, outside: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        for i, t in enumerate(outside):
            if isinstance(t, nn.Parameter):
                self.register_parameter(f"outside{i}", t)
        leaves, self.spec = tree_flatten(out)
        self.constants = [None if isinstance(t, torch.Tensor) else t for t in leaves]
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                real = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                if t.requires_grad:
                    self.register_parameter(f"leaf{i}", nn.Parameter(real))
                else:
                    self.register_buffer(f"leaf{i}", real)

    def forward(self) -> Any:
        leaves = [getattr(self, f"leaf{i}") if c is None else c for i, c in enumerate(self.constants)]
        return tree_unflatten(leaves, self.spec)


def _held(out: Any) -> list[torch.Tensor]:
    """The model's output tensors, returned by the traced step so that they live through
    the backward: a training loop that writes `out = model(x); loss = f(out)`, or reads
    `outputs.loss`, holds the output until the step ends, and a plan priced without it
    would exceed its budget by the output's bytes there; a key/value cache in the output
    holds its tensors as long."""
    leaves = output_leaves(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)] + [t for c in leaves if is_cache(c)
                                                                 for t in cache_tensors(c)]


def _set_by_forward(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the step made that modules hold as attributes once the forward returns
    (the weight `torch.nn.utils.weight_norm`'s or `spectral_norm`'s hook computes before
    each call, a table a forward caches as an attribute; not one kept in a container or on
    a helper object), returned by the traced step so that they live
    through the backward, as the module holds them until its next call: a plan
    checkpointing the call that reads one was priced as if it freed it, and the step
    measured 1.3 times its prediction."""
    return [value for module in model.modules() for value in module.__dict__.values() if isinstance(value, FakeTensor)]


def output_leaves(out: Any) -> list[Any]:
    """The leaves of a model's output: pytree's, with a plain dataclass (one pytree does
    not know) opened field by field."""
    found = []
    for leaf in tree_leaves(out):
        if is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_leaves([getattr(leaf, f.name) for f in fields(leaf)])
        else:
            found.append(leaf)
    return found


def _grad_leaves(out: Any) -> list[torch.Tensor]:
    leaves = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ExtractionError("the model's output has no tensor that requires grad; pass loss_fn or check the model")
    return leaves


def _seeds(roots: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradient `torch.autograd.grad` seeds a one-element root with (ones), made where
    the trace sees it (None for any other root, which it makes or refuses itself): its
    Python holds them until it returns, so the traced step returns them, as it returns
    the model's output (`_held`)."""
    return [torch.ones_like(r, memory_format=torch.preserve_format)
            if r.numel() == 1 and r.requires_grad and r.is_floating_point() else None for r in roots]


def _output_like(model: nn.Module, params: dict, buffers: dict, inputs: Call) -> list[torch.Tensor]:
    """Tensors shaped like the differentiable outputs, to stand for their gradients."""
    leaves = _grad_leaves(_fake_output(model, params, buffers, inputs))
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in leaves]


def fake_output(model: nn.Module, example_inputs: Sequence[Any] | Any) -> Any:
    """The model's output on fake tensors for `example_inputs` (as `trace` reads them),
    the model's Python state and the host's random state left as they were."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    with module_state.kept(model), host_random_kept(), _grouped_mm_in_any_float():
        return _fake_output(model, params, buffers, call_of(example_inputs))


def _fake_output(model: nn.Module, params: dict, buffers: dict, inputs: Call) -> Any:
    """The model's output on fake tensors: its structure, shapes and which leaves take a gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    traced_in(mode)
    with mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return _call(model, {k: fake(v) for k, v in params.items()}, {k: fake(v) for k, v in buffers.items()},
                     tree_map(fake, inputs))[0]


def _call(model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
          inputs: Call) -> tuple[Any, set[str]]:
    """`model(*args, **kwargs)` of the call `inputs` with `params` and `buffers` (keyed as `named_parameters` and
    `named_buffers` name them) in place of its own, and the names of the buffers its
    forward reassigned (`self.steps = self.steps + 1`). Each module attribute holding a
    tensor is set once: `functional_call`'s weight tying sets a module listed twice (in a
    Sequential, say) twice and restores it to the tensor passed in, not the model's own,
    while without tying an attribute tied to another module (an LM head sharing its
    embedding's weight) would not be set at all."""
    names = _attribute_names(model)
    given = {**params, **buffers}
    state = {path: given[name] for path, name in names.items()}
    out = torch.func.functional_call(model, state, inputs[0], inputs[1], tie_weights=False)
    reassigned = {names[path] for path, t in state.items() if names[path] in buffers and t is not given[names[path]]}
    return out, reassigned


def _attribute_names(model: nn.Module) -> dict[str, str]:
    """Per module attribute holding a parameter or buffer (its path through the first path
    of each distinct module), the tensor's name in `named_parameters` or `named_buffers`."""
    canonical = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    names = {}
    for path, module in model.named_modules():
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                names[f"{path}.{attr}" if path else attr] = canonical[id(t)]
    return names


@contextmanager
def _grouped_mm_in_any_float() -> Iterator[None]:
    """Shapes for `aten._grouped_mm` in float32 and float16 on fake tensors, as its eager
    CPU kernel computes them. Mixture-of-experts layers (transformers' Mixtral and Qwen MoE
    experts) call it in any float dtype, while PyTorch 2.13's meta rule demands bfloat16
    and 16-byte strides, so a trace would fail where the model runs. Other calls keep the
    rule PyTorch has; nothing changes outside the trace."""
    import torch._meta_registrations as meta

    common = getattr(meta, "_meta_grouped_mm_common", None)
    output = getattr(meta, "_create_grouped_mm_output_tensor", None)
    if common is None or output is None:
        yield
        return

    def relaxed(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: Any, scale_b: Any, offs: Any = None,
                bias: Any = None, scale_result: Any = None, out_dtype: Any = None, use_fast_accum: bool = False) -> Any:
        if scale_a is None and scale_b is None and mat_a.dtype in (torch.float32, torch.float16) \
                and mat_b.dtype == mat_a.dtype:
            return output(mat_a, mat_b, offs, out_dtype)
        return common(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)

    meta._meta_grouped_mm_common = relaxed
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = common


def _set_custom(**fields: Any) -> None:
    meta = fx_traceback.get_current_meta()
    custom = dict(meta.get("custom", {}))
    custom.update({f"{_MARK}_{k}": v for k, v in fields.items()})
    meta["custom"] = custom


@contextmanager
def _phase(name: str) -> Iterator[None]:
    _set_custom(phase=name, module="")
    try:
        yield
    finally:
        _set_custom(phase="forward")


def _scalar_loss(loss: Any) -> torch.Tensor:
    """What `loss_fn` returned, refused unless it is one floating-point number in a tensor
    (a loss with reduction="none" failed deep in the backward, blaming the model)."""
    if not isinstance(loss, torch.Tensor):
        raise ExtractionError(f"loss_fn must return the loss as a tensor holding one number, not "
                              f"{type(loss).__name__}")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ExtractionError(f"loss_fn must return the loss as a tensor holding one floating-point number, not a "
                              f"{loss.dtype} tensor of shape {list(loss.shape)} (reduce it: .mean() or .sum())")
    return loss


@contextmanager
def _tag_grad_fns(roots: list[torch.Tensor], python: set[int], on_ctx: set[int], resident: Any) -> Iterator[None]:
    """Tag the ops each autograd node runs in the backward with its sequence number, which
    the forward ops that created it carry as `seq_nr`; add to `python` the sequence numbers
    of nodes whose backward is Python's (a `torch.autograd.Function`), and to `on_ctx`
    those of such nodes whose `ctx` keeps tensors the step computes as attributes, not
    `save_for_backward` (a weight or an input among `resident` costs nothing there):
    checkpoint cannot drop those, which live as long as the node."""
    standing = set(_storages(resident))
    def enter(seq_nr: int) -> Callable:
        return lambda grad_outputs: _set_custom(grad_of=seq_nr)

    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        _set_custom(grad_of=None)

    handles, seen = [], set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        handles += [fn.register_prehook(enter(fn._sequence_nr())), fn.register_hook(leave)]
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            python.add(fn._sequence_nr())
            if set(_storages(list(vars(fn).values()))) - standing:
                on_ctx.add(fn._sequence_nr())
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    try:
        yield
    finally:
        _set_custom(grad_of=None)
        for handle in handles:
            handle.remove()


def _grad_of(gm: torch.fx.GraphModule, graph: Graph) -> np.ndarray:
    """Per Graph node, the forward op whose autograd node ran it (see `Traced`): the first
    forward op with that sequence number, as later ops that create no autograd node
    repeat the last one."""
    index = {name: i for i, name in enumerate(graph.names)}
    creator: dict[int, int] = {}
    grad_of = np.full(graph.n, -1, dtype=np.int64)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in index:
            continue
        seq_nr = node.meta.get("custom", {}).get(f"{_MARK}_grad_of")
        if seq_nr is not None:
            grad_of[index[node.name]] = creator.get(seq_nr, -1)
        elif not graph.backward[index[node.name]] and "seq_nr" in node.meta:
            creator.setdefault(node.meta["seq_nr"], index[node.name])
    return grad_of


@contextmanager
def _module_paths(model: nn.Module, cached: set[tuple[str, int]], drawing: set[tuple[str, int]],
                  stateful: set[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    """Tag traced nodes with the path of the module running them and the stack of module
    calls (path, call number) around them (yielded, the model's own call first, as it
    stands); add to `cached` each call handed a key/value
    cache (`kv_cache`), to `drawing` each call that draws from numpy's or Python's
    random numbers (their state changed while it ran), which checkpoint does not restore,
    and to `stateful` each call that changes its module's Python state
    (`module_state.python_state`: a counter, a cache), which a rerun would change again,
    and each call whose module's Python state is not, when the model's forward returns,
    what the call began with (a caller setting a shared object's "current layer" before
    each block), unless only plain values of its own attributes or of the plain objects
    it holds changed, which the runtime puts back for a rerun (`module_state.restored_plain`:
    a config field the model's head sets on the first call): otherwise its rerun in the
    backward, or that of a call around it, would read what was set last. (What the loss or
    a backward hook changes later, a log of gradient norms, no rerun reads.)"""
    stack: list[tuple[str, int]] = [("", 0)]
    states: list[Any] = []
    began: list[tuple[tuple[tuple[str, int], ...], nn.Module, Any, Any]] = []
    count: dict[str, int] = {}

    def tag() -> None:
        _set_custom(module=stack[-1][0], calls="|".join(f"{path}#{k}" for path, k in stack[1:]))

    def enter(path: str, scripted: bool) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            stack.append((path, count.get(path, 0)))
            if scripted:  # a scripted module's first runs profile another graph than its rerun would run
                stateful.add(stack[-1])
            states.append((host_random_states(), module_state.python_state(module)))
            began.append((tuple(stack[1:]), module, states[-1][1], module_state.attribute_spaces([module])))
            count[path] = count.get(path, 0) + 1
            if receives_cache(args, kwargs):
                cached.add(stack[-1])
            tag()
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        host_random, python = states.pop()
        if not same_host_random(host_random, host_random_states()):
            drawing.add(stack[-1])
        if python != module_state.python_state(module):
            stateful.update(stack[1:])  # the calls around it rerun it too
        stack.pop()
        tag()

    def returned(model: nn.Module, args: Any, output: Any) -> None:
        ends: dict[int, Any] = {}
        for calls, module, python, spaces in began:
            if id(module) not in ends:
                ends[id(module)] = module_state.python_state(module)
            if python == ends[id(module)]:
                continue
            with module_state.restored_plain(spaces):
                if python != module_state.python_state(module):
                    stateful.update(calls)
        began.clear()

    handles = [model.register_forward_hook(returned)]
    for path, module in model.named_modules():
        if path and not isinstance(module, torch.jit.ScriptModule):
            scripted = any(isinstance(m, torch.jit.ScriptModule) for m in module.modules())
            handles.append(module.register_forward_pre_hook(enter(path, scripted), with_kwargs=True))
            handles.append(module.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _reentrant_checkpoint_refused() -> Iterator[None]:
    """While tracing, an ExtractionError from `torch.utils.checkpoint(use_reentrant=True)`:
    its backward runs outside the autograd graph `torch.autograd.grad` follows, so the
    trace would compute no gradient through it (or fail)."""
    function = torch.utils.checkpoint.CheckpointFunction

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ExtractionError("the model runs torch.utils.checkpoint with use_reentrant=True, whose backward a trace "
                              "cannot follow: use use_reentrant=False (transformers: gradient_checkpointing_enable("
                              "gradient_checkpointing_kwargs={'use_reentrant': False})), or turn the model's own "
                              "checkpointing off and let the plan choose")

    before = function.__dict__.get("apply")
    function.apply = refuse
    try:
        yield
    finally:
        if before is None:
            del function.apply
        else:
            function.apply = before


def host_random_states() -> tuple[Any, Any]:
    """The states of numpy's and Python's global random number generators."""
    return np.random.get_state(), random.getstate()


def same_host_random(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two `host_random_states()` are the same states."""
    return a[1] == b[1] and a[0][2:] == b[0][2:] and np.array_equal(a[0][1], b[0][1])


@contextmanager
def host_random_kept(at: tuple[Any, Any] | None = None) -> Iterator[None]:
    """Leave numpy's and Python's random number generators as they were: tracing runs the
    model's Python (and reading an example batch a collator's), and a draw there would
    change what training draws next. With `at` (their `host_random_states()`), they are
    at those states while it lasts."""
    numpy_state, python_state = host_random_states()
    if at is not None:
        np.random.set_state(at[0])
        random.setstate(at[1])
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


@contextmanager
def _python_holds(model: nn.Module) -> Iterator[dict[str, str]]:
    """While tracing, what eager Python holds past its last read: a module call's tensor
    arguments until the call returns, the tensors of a tuple a call returns (unpacked
    into its caller's locals) until the caller returns, what
    scaled_dot_product_attention holds in its own (`_AttentionLocals`), and what the
    variables of the model's Python functions hold as each torch call runs
    (`_FunctionLocals`). Yields, filled in as calls return, per fx node name the name of
    the last node traced while it is held."""
    holds: dict[str, str] = {}
    frames: list[list[torch.fx.Node]] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        frames.append(_traced_nodes((args, kwargs)))

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        _hold(holds, frames.pop())
        if frames and isinstance(output, tuple):
            frames[-1].extend(_traced_nodes(output))

    handles = []
    for module in model.modules():
        if isinstance(module, torch.jit.ScriptModule):  # takes no hooks; its calls are its caller's
            continue
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True))
    try:
        with _AttentionLocals(holds), _FunctionLocals(holds, lambda: bool(frames)):
            yield holds
    finally:
        for handle in handles:
            handle.remove()


def _hold(holds: dict[str, str], nodes: list[torch.fx.Node]) -> None:
    """Record in `holds` that eager holds the tensors of `nodes` until now, the node
    traced last."""
    last = _last_traced()
    if last is not None:
        holds.update((node.name, last.name) for node in nodes)


_TRACING_CODE = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parents[1]) + os.sep)
"""Where torch's and optremat's own Python lives: under a trace its frames are the
tracer's, fake tensors' and decompositions' as much as the model's."""


class _FunctionLocals(TorchFunctionMode):
    """While tracing within a module call (`inside`), record in `holds` what the variables
    of the Python functions running a torch call hold as it returns, those of torch's and
    optremat's code aside: eager frees a variable's tensor only when the variable is bound
    again or its function returns, past the last op reading it (transformers'
    `sdpa_attention_forward` holds the keys `repeat_kv` made and the mask it built
    through the attention and the copy of its output)."""

    def __init__(self, holds: dict[str, str], inside: Callable[[], bool]) -> None:
        super().__init__()
        self.holds, self.inside = holds, inside

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = _last_traced()
        out = func(*args, **(kwargs or {}))
        if self.inside() and _last_traced() is not before:
            _hold(self.holds, _traced_nodes(_variables(sys._getframe(1))))
        return out


def _variables(frame: Any) -> list[Any]:
    """The values of the variables of `frame` and of the frames that called it, up to the
    traced step's model call (`_call`), outside torch's and optremat's code."""
    values = []
    while frame is not None and frame.f_code is not _call.__code__:
        if not frame.f_code.co_filename.startswith(_TRACING_CODE):
            values += frame.f_locals.values()
        frame = frame.f_back
    return values


class _AttentionLocals(TorchFunctionMode):
    """While tracing, record in `holds` what `F.scaled_dot_product_attention` holds in its
    C++ variables until it returns, past their last read: the additive mask it converts a
    boolean one to (`where`), and the results of the ops reading its query, key or value
    themselves (the math kernel's scaled query)."""

    def __init__(self, holds: dict[str, str]) -> None:
        super().__init__()
        self.holds = holds

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        before = _last_traced() if func is nn.functional.scaled_dot_product_attention else None
        out = func(*args, **kwargs)
        if before is not None:
            given = set(_traced_nodes((args[:3], [kwargs.get(k) for k in ("query", "key", "value")])))
            _hold(self.holds, [node for node in _traced_since(before) if node.target is torch.ops.aten.where.self
                               or (not is_view(node) and given & set(node.all_input_nodes))])
        return out


def _traced_since(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes the trace under way recorded after `node`."""
    found = []
    while node.next.op != "root":
        node = node.next
        found.append(node)
    return found


def _traced_nodes(value: Any) -> list[torch.fx.Node]:
    """The fx nodes of the tensors in `value` that the trace under way tracks."""
    mode = get_proxy_mode()
    if mode is None:
        return []
    slots = [get_proxy_slot(t, mode.tracer, None) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return [slot.proxy.node for slot in slots if slot is not None]


def _last_traced() -> torch.fx.Node | None:
    """The node the trace under way recorded last."""
    mode = get_proxy_mode()
    return None if mode is None else next(iter(reversed(mode.tracer.graph.nodes)), None)


def _lives_to(graph: Graph, holds: dict[str, str], index: dict[str, int], formulas: dict[int, list[int]],
              python: set[int], calls: tuple[tuple[tuple[str, int], ...], ...]) -> np.ndarray:
    """`Graph.lives_to` of a traced step: what Python holds (`_python_holds`, and the
    variables `_viewed_returns` finds), and the ops each autograd node runs in the
    backward, whose results its C++ formula holds
    until the formula returns (its temporaries die with the statement or the function,
    its outputs are passed on), so until the last of them (`_formulas`). A Python
    backward (`python`) drops a temporary as soon as its expression has read it, and holds
    a named variable until it returns: taken to be the results read more than once, and
    those no op reads (handed to `torch.autograd.grad`, as a formula recomputing its op
    under `enable_grad` does: held until that call returns)."""
    lives_to = _viewed_returns(graph, calls)
    for name, last in holds.items():
        if name in index and last in index:
            lives_to[index[name]] = max(lives_to[index[name]], index[last])
    for seq_nr, ops in formulas.items():
        named = [v for v in ops if len(graph.succs[v]) != 1] if seq_nr in python else ops
        lives_to[named] = np.maximum(lives_to[named], max(ops))
    return np.where(lives_to > np.arange(graph.n), lives_to, -1)


def _viewed_returns(graph: Graph, calls: tuple[tuple[tuple[str, int], ...], ...]) -> np.ndarray:
    """Per node, the last node its caller runs where a module call's result is read in the
    caller's own code only by views (`q = self.q_proj(x).view(...).transpose(1, 2)`): a
    Python variable of the caller then holds it until the caller returns, past the last
    op reading it (-1 elsewhere)."""
    last: dict[tuple[str, int], int] = {}
    for v, stack in enumerate(calls):
        for call in stack:
            last[call] = v
    held = np.full(graph.n, -1, dtype=np.int64)
    for u, stack in enumerate(calls):
        if len(stack) < 2 or graph.kind[u] != "op" or graph.backward[u]:
            continue
        call, caller = stack[-1], stack[-2]
        readers = [w for w in graph.succs[u].tolist() if not graph.backward[w] and call not in calls[w]]
        own = [w for w in readers if calls[w] and calls[w][-1] == caller]
        if own and all(graph.alias_of[w] == u for w in own):
            held[u] = last[caller]
    return held


def _constants_once(gm: torch.fx.GraphModule, graph: Graph, index: dict[str, int], real: list) -> np.ndarray:
    """`graph.size`, 0 for each constant the trace recorded (a tensor the loss holds from
    outside the step) whose storage is a parameter's, a buffer's, an input's or an earlier
    constant's: a loss's labels that are the batch's own are priced once, as the input,
    and a target the loss's forward and backward both read (each recorded as a constant of
    its own) once."""
    storages = {t.untyped_storage()._cdata for t in real if isinstance(t, torch.Tensor)}
    size = graph.size.copy()
    for node in gm.graph.nodes:
        value = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if not isinstance(value, torch.Tensor) or node.name not in index:
            continue
        if value.untyped_storage()._cdata in storages:
            size[index[node.name]] = 0
        storages.add(value.untyped_storage()._cdata)
    size.setflags(write=False)
    return size


def _formulas(gm: torch.fx.GraphModule, index: dict[str, int]) -> dict[int, list[int]]:
    """The Graph nodes (by name in `index`) of each autograd node's backward formula, in
    order, by the node's sequence number."""
    formulas: dict[int, list[int]] = {}
    for node in gm.graph.nodes:
        seq_nr = node.meta.get("custom", {}).get(f"{_MARK}_grad_of")
        if seq_nr is not None and node.name in index:
            formulas.setdefault(seq_nr, []).append(index[node.name])
    return formulas


SAVED_WHOLE = {torch.ops.aten.gather.default: 0}
"""Ops whose autograd node saves an argument (by position) that its formula, as traced,
reads only for its shape: eager holds the whole tensor until the formula runs."""


def _formula_reads(graph: Graph, formulas: dict[int, list[int]], gm: torch.fx.GraphModule,
                   grad_of: np.ndarray) -> np.ndarray:
    """`graph`'s edges, and one from each input of a backward formula to the formula's last
    op: the engine holds what an autograd node saved, and the gradient it was passed,
    until the node's whole formula has returned, whichever computation of a tensor it read
    (the forward's, or a checkpoint's recomputation); so too for the arguments
    `SAVED_WHOLE` names, which the traced formula does not read."""
    edges = set(map(tuple, graph.edges.tolist()))
    index = {name: i for i, name in enumerate(graph.names)}
    nodes = {node.name: node for node in gm.graph.nodes}
    for ops in formulas.values():
        inside, last = set(ops), max(ops)
        edges |= {(p, last) for v in ops for p in graph.preds[v].tolist() if p not in inside}
        forward = nodes[graph.names[grad_of[ops[0]]]] if grad_of[ops[0]] >= 0 else None
        saved = SAVED_WHOLE.get(getattr(forward, "target", None))
        if saved is not None and isinstance(forward.args[saved], torch.fx.Node):
            edges.add((index[forward.args[saved].name], last))
    array = np.array(sorted(edges), dtype=np.int64).reshape(-1, 2)
    array.setflags(write=False)
    return array


def accumulated_in_place(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Per sum of two gradients that autograd's engine makes between its nodes (a tied
    weight's, a residual stream's), the gradient it adds the other into. Eagerly the engine
    adds into the first gradient to arrive where nothing else holds it (a dense tensor of
    its own, not a view, which keeps its base, and read by nothing else), else makes a new
    one (never into the second, a dense one: `InputBuffer::accumulate`); a trace on fake
    tensors, a tensor subclass, always records a new one, the first its first argument.
    So too for a backward formula's `scatter_add_` into zeros of its own (gather's),
    which the trace records out of place."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    kept = set(tree_leaves(output.args[0]))
    found = {}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom", {})
        if node.target is torch.ops.aten.scatter_add.default and custom.get(f"{_MARK}_phase") == "backward" \
                and getattr(node.args[0], "target", None) is torch.ops.aten.new_zeros.default \
                and _held_only_by(node.args[0], node, kept):
            found[node] = node.args[0]
        if node.target is not torch.ops.aten.add.Tensor or custom.get(f"{_MARK}_phase") != "backward" \
                or custom.get(f"{_MARK}_grad_of") is not None:
            continue
        if _held_only_by(node.args[0], node, kept):
            found[node] = node.args[0]
    return found


def _held_only_by(t: Any, node: torch.fx.Node, kept: set) -> bool:
    if not isinstance(t, torch.fx.Node) or t.op != "call_function" or len(t.users) != 1 or t in kept:
        return False
    value, result = t.meta.get("val"), node.meta.get("val")
    return (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor) and _viewed(t) is t
            and value.shape == result.shape and value.dtype == result.dtype
            and value.untyped_storage().nbytes() == value.numel() * value.element_size()
            and torch._prims_common.is_non_overlapping_and_dense_or_false(value))


def _call_stack(node: torch.fx.Node) -> tuple[tuple[str, int], ...]:
    text = node.meta.get("custom", {}).get(f"{_MARK}_calls", "")
    return tuple((path, int(k)) for path, _, k in (item.rpartition("#") for item in text.split("|") if item))


BATCH_NORMS = ("native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "miopen_batch_norm")


def depending_on(graph: Graph, sources: list[int]) -> np.ndarray:
    """The op nodes that read, directly or not, one of `sources`."""
    depends = np.zeros(graph.n, dtype=bool)
    depends[sources] = True
    for v in range(graph.n):
        if not depends[v] and depends[graph.preds[v]].any():
            depends[v] = True
    return depends & ~graph.pinned


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx nodes whose tensors `node` writes in place."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = [node.args[i] if i < len(node.args) else node.kwargs.get(a.name)  # `out=` is a keyword
               for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    name = schema.name.removeprefix("aten::")
    if name in BATCH_NORMS and len(node.args) > 5 and node.args[5] is True:
        written += node.args[3:5]
    return [v for v in written if isinstance(v, torch.fx.Node)]


def _mutated_buffers(gm: torch.fx.GraphModule, params: list[str], buffers: list[str]) -> tuple[str, ...]:
    """Names of the buffers that forward ops write in place."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders[len(params):len(params) + len(buffers)], buffers))
    written = {names[p] for n in gm.graph.nodes if n.op == "call_function" for p in mutated_inputs(n) if p in names}
    return tuple(sorted(written))


_PRODUCTS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.bmm: (0, 1), torch.ops.aten.addmm: (1, 2),
             torch.ops.aten.baddbmm: (1, 2), torch.ops.aten.convolution: (0, 1)}
"""Matrix products and convolutions, by the positions of the two operands their kernels
require of one dtype."""


def _refuse_mixed_products(model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """Refuse a matrix product or convolution of two dtypes. Fake tensors compute one
    (an int64 batch into a Linear gives float32), the model's kernels refuse it, and a plan
    traced through it prices a step that cannot run."""
    for node in gm.graph.nodes:
        operands = _PRODUCTS.get(getattr(node.target, "overloadpacket", None), ())
        values = [getattr(node.args[i], "meta", {}).get("val") for i in operands]
        dtypes = [v.dtype for v in values if isinstance(v, torch.Tensor)]
        if len(set(dtypes)) > 1:
            calls = _call_stack(node)
            where = f"module '{calls[-1][0]}'" if calls and calls[-1][0] else f"{type(model).__name__}.forward"
            raise ExtractionError(f"could not trace the training step: {node.target} in {where} multiplies a "
                                  f"{dtypes[0]} tensor by a {dtypes[1]} one, which PyTorch's kernels refuse: check "
                                  "the example inputs' dtypes (an integer batch given to a layer that takes floats, "
                                  "a float32 batch to a model cast to bfloat16)")


def _explain_failure(model: nn.Module, error: Exception, where: str) -> str:
    text = str(error)
    ops = re.findall(r"aten\.[A-Za-z0-9_.]+", text)
    op = ops[0] if ops else type(error).__name__
    module = f"module '{where}'" if where else f"{type(model).__name__}.forward"
    first_line = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
    failed = dict(model.named_modules()).get(where, model)
    cumulative = [path for path, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None]
    data_dependent = ("data-dependent" in text or "_local_scalar_dense" in text
                      or "DataDependent" in type(error).__name__)
    compiled = [path for path, m in model.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule)]
    if compiled and "dynamo" in text:
        hint = (f"module '{compiled[0] or type(model).__name__}' is compiled (module.compile() or torch.compile), "
                "and a trace cannot enter compiled code: plan and apply first, then compile the modules (planned "
                "modules run under torch.compile)")
    elif isinstance(failed, nn.RNNBase) and "FakeTensor" in text:
        hint = ("an RNN given a PackedSequence runs as many steps per sequence as its lengths' values say, which "
                "no trace on fake tensors can follow: optremat cannot plan it yet; run the RNN on the padded batch "
                "to plan it")
    elif cumulative and (where in cumulative or not where) and data_dependent:
        hint = (f"a BatchNorm with momentum=None ('{where or cumulative[0]}') keeps a cumulative average, weighting "
                "each step by 1 / num_batches_tracked read as a Python number, which a trace on fake tensors "
                "cannot read: optremat cannot plan it; give it a momentum (PyTorch's default is 0.1)")
    elif data_dependent:
        hint = ("the model reads a tensor's value in Python (.item(), .tolist(), `if tensor:`) that the trace "
                "cannot compute from the example batch (it follows a random op, or the model is on the meta "
                "device); make that check skippable during tracing or move it out of forward")
    elif "DynamicOutputShape" in type(error).__name__ or "DynamicOutputShape" in type(error.__cause__).__name__:
        hint = ("the op's output size depends on its inputs' values (a CTC loss's on the target lengths), which no "
                "trace on fake tensors can size: optremat cannot plan a step that runs it yet")
    else:
        hint = "run the model once eagerly on the same inputs to check it works; if it does, report this op"
    return f"could not trace the training step: {op} failed in {module}: {first_line}. Hint: {hint}."


def _costs(gm: torch.fx.GraphModule, args: tuple, cost_model: str, profile: DeviceProfile) -> dict[str, float]:
    if cost_model == "profile":  # on copies of the tensors the step writes into, so the model stays as it was
        written = {_viewed(p).name for n in gm.graph.nodes if n.op == "call_function" for p in mutated_inputs(n)}
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        real = [t.clone() if name in written else t for t, name in zip(tree_leaves(args), placeholders)]
        return profile_costs(gm, real, once=lambda n: bool(mutated_inputs(n)))
    return {n.name: roofline_cost(n, profile) for n in gm.graph.nodes if n.op == "call_function"}


def _viewed(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor `node` views, through views and detaches (itself if none)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        returns = getattr(getattr(node.target, "_schema", None), "returns", ())
        if not returns or returns[0].alias_info is None or returns[0].alias_info.is_write:
            break
        node = node.args[0]
    return node


def is_view(node: torch.fx.Node) -> bool:
    """Whether `node` returns one tensor that its schema says views its first input."""
    returns = getattr(getattr(node.target, "_schema", None), "returns", ())
    return (len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write
            and isinstance(node.meta.get("val"), torch.Tensor) and bool(node.args)
            and isinstance(node.args[0], torch.fx.Node))


def _storages(value: Any) -> dict[StorageWeakRef, int]:
    """The distinct storages behind a node's value, with their bytes."""
    return {StorageWeakRef(t.untyped_storage()): int(concrete(t.untyped_storage().nbytes()))
            for t in tree_leaves(value) if isinstance(t, torch.Tensor)}


def tensor_type(value: Any) -> str:
    """The dtype and shape of each tensor in `value`, as a Graph names a node's type."""
    parts = []
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            parts.append(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
    return ",".join(parts)


def to_graph(fx_nodes: list[torch.fx.Node], placeholder_kinds: list[str], param_names: list[str],
             costs: dict[str, float], results: list[Any], is_backward: Callable[[torch.fx.Node], bool],
             written_into: dict[torch.fx.Node, torch.fx.Node] | None = None, *, cpu: bool = True) -> Graph:
    """The Graph of a traced step's fx nodes, listed in a topological order with the
    placeholders and constants first: `placeholder_kinds` ("param", "input", or "op" for
    a placeholder computed within the step) and `param_names` (for the module a parameter
    belongs to) in placeholder order, each op's cost by node name, the nodes that must
    survive the step (`results`), and which nodes run in the backward. Sizes and aliases
    come from the fake tensors in `node.meta["val"]`, but for the ops `written_into` maps
    to the input they run in place over (`accumulated_in_place`); `cpu` prices the CPU's
    own kernels' scratch (`costs.workspace_bytes`, the low-precision matrix products'
    measured by running them: `onednn.size_matmul_scratch`)."""
    written_into = written_into or {}
    if cpu:
        size_matmul_scratch(fx_nodes)
    index = {n: i for i, n in enumerate(fx_nodes)}
    owner: dict[StorageWeakRef, int] = {}
    parts: dict[StorageWeakRef, int] = {}
    cols: dict[str, list] = {k: [] for k in ("names", "ops", "cost", "size", "backward", "kind", "module",
                                            "alias_of", "fusible", "workspace", "tensor")}
    edges = []
    placeholder = 0
    for i, node in enumerate(fx_nodes):
        value = node.meta.get("val")
        custom = node.meta.get("custom", {})
        preds = [index[p] for p in node.all_input_nodes]
        edges += [(p, i) for p in preds]
        if node.op == "placeholder":
            kind = placeholder_kinds[placeholder]
            module = param_names[placeholder].rpartition(".")[0] if placeholder < len(param_names) else ""
            placeholder += 1
        else:
            kind = "input" if node.op == "get_attr" else "op"
            module = custom.get(f"{_MARK}_module", "")
        storages = _storages(value)
        fresh = {r: nbytes for r, nbytes in storages.items() if r not in owner}
        alias_of = -1
        if kind == "op" and storages and not fresh:
            roots = {owner[r] for r in storages}
            alias_of = next((p for p in preds if _root(cols["alias_of"], p) in roots), -1)
        elif kind == "op" and fresh and is_view(node):
            alias_of = index[node.args[0]]  # of a constant, whose recorded tensor is not the one traced
        into = written_into.get(node)
        if into is not None:
            alias_of = index[into]
        for r in fresh:
            owner[r] = i if alias_of < 0 else _root(cols["alias_of"], alias_of)
        size = storage_bytes(node, sum(fresh.values())) if alias_of < 0 else 0
        if node.target is operator.getitem and alias_of >= 0 and cols["alias_of"][alias_of] < 0:
            earlier = next((parts[r] for r in storages if r in parts), -1)
            if earlier >= 0:
                # the op returns one tensor twice (mkldnn_rnn_layer_backward's bias gradient): a view of the first
                alias_of, size = earlier, 0
                edges.append((earlier, i))
            else:
                size = sum(storages.values())
                parts.update(dict.fromkeys(storages, i))
                if size == 0:
                    # an empty output (cuDNN batch norm's reserve, say) keeps none of its op's other outputs alive
                    alias_of = -1
        target = node.target
        op_name = getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op
        if hasattr(target, "_schema"):
            op_name = str(target).removeprefix("aten.")
        cols["names"].append(node.name)
        cols["ops"].append(op_name)
        writes = writes_in_place(node) or into is not None  # shares the storage it writes, costs what it computes
        cols["cost"].append(0.0 if (alias_of >= 0 and not writes) or kind != "op" or node.target is operator.getitem
                            else costs.get(node.name, 0.0))
        cols["size"].append(int(size))
        cols["backward"].append(bool(is_backward(node)))
        cols["kind"].append(kind)
        cols["module"].append(module)
        cols["alias_of"].append(alias_of)
        cols["fusible"].append(alias_of >= 0 or _pointwise(target))
        cols["workspace"].append(workspace_bytes(node, cpu) if node.op == "call_function" else 0)
        cols["tensor"].append(tensor_type(value))
    output = [False] * len(fx_nodes)
    for node in results:
        if isinstance(node, torch.fx.Node):
            output[index[node]] = True
    _backward_paths(cols, edges)
    return Graph.build(edges=edges, output=output, **cols)


def _root(alias_of: list[int], i: int) -> int:
    while alias_of[i] >= 0:
        i = alias_of[i]
    return i


def _pointwise(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags or target is operator.getitem


def _backward_paths(cols: dict[str, list], edges: list[tuple[int, int]]) -> None:
    """Give each backward op the module of the forward tensor (or param) it reads."""
    preds: dict[int, list[int]] = {}
    for src, dst in edges:
        preds.setdefault(dst, []).append(src)
    for i, is_backward in enumerate(cols["backward"]):
        if not is_backward or cols["module"][i]:
            continue
        candidates = sorted(preds.get(i, []), key=lambda p: (cols["backward"][p], -p))
        cols["module"][i] = next((cols["module"][p] for p in candidates if cols["module"][p]), "")
