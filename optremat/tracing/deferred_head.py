"""A model's LM head deferred until a cross-entropy reads its logits, then run in chunks.

A model that takes its own loss in its forward (`logits = self.lm_head(x)`, then
`F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))`, as nanoGPT and
minGPT do) holds the whole logits however its activations are planned. While
`deferring(heads, chunks)` lasts, each of those head modules (plain `nn.Linear`s)
returns `DeferredLogits`: a tensor of the logits' shape, dtype and device that holds no
data, only the head's input. Reshaping it, and casting it to float32, give
`DeferredLogits` again. `F.cross_entropy` over ones flattened to one row per position,
in float32, against one target per row, without class weights and reduced by mean or
sum, is computed from the head's input by `CausalLMLoss` in `chunks` token chunks. Any
other read of them (an op, a hook, a return from the forward) gets the logits
themselves, computed then by the head's own forward with the reshapes and casts
replayed: the step computes what the model computes, holding the whole logits where
the model reads them otherwise.
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from optremat.tracing.lm_loss import CausalLMLoss, cross_entropy_arguments, loss_options

WIDENING = 4
"""How many times wider than its input a head's output is: an LM head's vocabulary is
8 (Llama) to 100 (Gemma) times its width; a classifier's classes are about its width."""

_RESHAPES = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.reshape, torch.flatten})
_CASTS = frozenset({torch.Tensor.float, torch.Tensor.to, torch.Tensor.type})
_METADATA = frozenset({torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.shape.__get__,
                       torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                       torch.Tensor.requires_grad.__get__, torch.Tensor.is_floating_point})

_CHUNKED = WeakIdKeyDictionary()
"""A forward's output built on a loss a deferred head's cross-entropy computed in
chunks -> that head, and the positions it covers."""

_MADE = threading.local()
"""The losses deferred heads' cross-entropies computed in the forward running on this
thread (`deferring`), with their heads and positions, and the roots made there."""

_THIS = threading.local()
"""id(head) -> the chunks a head deferred on this thread runs its loss in."""

_LOCK = threading.Lock()
_DEFERRING: dict[nn.Module, Callable[..., Any]] = {}
"""Each head deferred on some thread -> the forward set on it."""
_USERS: dict[nn.Module, int] = {}
"""Each head deferred -> on how many threads and forwards at once."""


def deferrable(module: nn.Module) -> bool:
    """Whether `module` can be deferred: a plain `nn.Linear` (no subclass, no forward of
    its own set on it but a deferring one) at least `WIDENING` times wider than its input."""
    own = vars(module).get("forward")
    return (type(module) is nn.Linear and (own is None or own is _DEFERRING.get(module))
            and module.out_features >= WIDENING * module.in_features)


def chunked_by(t: Any) -> tuple[nn.Linear, int] | None:
    """The head and the positions covered, where `t` is a forward's output built on a
    loss a deferred head's cross-entropy computed in chunks (`returned`); None otherwise."""
    return _CHUNKED.get(t) if isinstance(t, torch.Tensor) else None


def _built_on(t: torch.Tensor, losses: list[tuple[torch.Tensor, nn.Linear, int]]) -> tuple[nn.Linear, int] | None:
    """The head and positions of the one head among `losses` whose losses `t`'s autograd graph holds."""
    nodes = {loss.grad_fn: (head, rows) for loss, head, rows in losses}
    if t.grad_fn in nodes:  # the loss itself, as a forward mostly returns it
        return nodes[t.grad_fn]
    reached, seen, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in nodes:
            reached.add(nodes[node])
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached.pop() if len(reached) == 1 else None


class DeferredLogits(torch.Tensor):
    """The logits `head` would compute from `hidden`, reshaped and cast by `steps`
    (each a function and its further arguments), not computed yet; `root` is the head's
    own output they were made from (itself for that one), `chunks` the token chunks a
    cross-entropy over them runs in.

    Once anything but a reshape, a cast or the chunked cross-entropy reads any of a
    root's logits (an in-place write, a gradient hook), the root's logits are computed
    (`value`), and with them, at that moment, every reshape and cast made of them so far,
    as the model made them then: reshapes alias the computed logits, as views do, and a
    cast to another dtype is a copy of them before the read's write. From then on they
    are plain tensors to every op, the cross-entropy too."""

    hidden: torch.Tensor
    head: nn.Linear
    chunks: int
    steps: tuple[tuple[Callable[..., Any], tuple, dict], ...]
    root: "DeferredLogits"
    chunked: bool
    value: torch.Tensor | None
    version: int
    made: list[weakref.ref]
    closed: bool

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, head: nn.Linear, chunks: int,
                steps: tuple[tuple[Callable[..., Any], tuple, dict], ...] = (),
                root: "DeferredLogits | None" = None) -> "DeferredLogits":
        with _disable_current_modes():
            like = torch.empty((*hidden.shape[:-1], head.out_features), dtype=hidden.dtype, device="meta")
            for func, args, kwargs in steps:
                like = func(like, *args, **kwargs)
        grad = hidden.requires_grad or any(p is not None and p.requires_grad for p in (head.weight, head.bias))
        made = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=hidden.device,
                                                   requires_grad=grad)
        made.hidden, made.head, made.chunks, made.steps = hidden, head, chunks, steps
        made.chunked, made.value, made.version, made.made, made.closed = False, None, hidden._version, [], False
        made.root = made if root is None else root
        if root is not None:
            root.made.append(weakref.ref(made))
        elif getattr(_MADE, "roots", None) is not None:
            _MADE.roots.append(weakref.ref(made))
        return made

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return f"DeferredLogits(shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, DeferredLogits) and func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if isinstance(first, DeferredLogits) and first.root.value is None and (
                func in _RESHAPES or (func in _CASTS and _casts_to_float32(func, args[1:], kwargs))):
            return DeferredLogits(first.hidden, first.head, first.chunks, (*first.steps, (func, args[1:], kwargs)),
                                  first.root)
        if func is F.cross_entropy:
            loss = _chunked_cross_entropy(args, kwargs)
            if loss is not None:
                return loss
        return func(*tree_map(_computed, args), **tree_map(_computed, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"optremat: {func} reached a deferred LM head's logits below autograd, where they cannot "
                           "be computed; plan with head_chunks=None to run the head as the model does")

    def computed(self) -> torch.Tensor:
        """The logits themselves: the head's own forward over the hidden states (once, as
        the model computes them once), reshaped and cast as the model did."""
        root = self.root
        if root.value is None:
            root.unchanged_input()
            if root.closed:
                raise RuntimeError("optremat: these LM head logits were not kept: the step took its loss over them in "
                                   "chunks and its forward returned; plan with head_chunks=None to keep them")
            with torch.enable_grad(), torch.autocast(root.hidden.device.type, enabled=False):
                root.value = type(root.head).forward(root.head, root.hidden)  # as the head call ran
            for ref in root.made:
                made = ref()
                if made is not None:
                    made.value = made.replayed()
        if self.value is None:
            self.value = self.replayed()
        return self.value

    def replayed(self) -> torch.Tensor:
        """The root's computed logits with this one's reshapes and casts."""
        out = self.root.value
        for func, args, kwargs in self.steps:
            out = func(out, *args, **kwargs)
        return out

    def unchanged_input(self) -> None:
        """Refuse hidden states written in place since the head read them: the logits the
        model computed from them are gone (and with a head that takes a gradient, the
        model's own backward would refuse them too)."""
        if self.hidden._version != self.version:
            raise RuntimeError("optremat: the input of the LM head was written in place after the head read it, so "
                               "the head's deferred logits cannot be computed as the model computed them: write a "
                               "copy, or plan with head_chunks=None")


def _chunked_cross_entropy(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """`F.cross_entropy(*args, **kwargs)` by `CausalLMLoss` in chunks, where its input is
    deferred logits and it computes the same loss so; None otherwise."""
    given = cross_entropy_arguments(args, kwargs)
    logits, target = given["input"], given["target"]
    if not isinstance(logits, DeferredLogits) or logits.root.value is not None:
        return None
    logits.root.unchanged_input()
    hidden, head = logits.hidden, logits.head
    rows = hidden.shape[:-1].numel()
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = logits.shape, logits.dtype
    options = loss_options(given)
    if (rows == 0 or dtype != torch.float32 or shape != (rows, head.out_features) or not _plain(target)
            or target.shape != (rows,) or target.dtype not in (torch.long, torch.uint8) or options is None):
        return None
    with torch.autocast(hidden.device.type, enabled=False):  # the logits are the head call's, outside autocast
        loss = CausalLMLoss(head, target, **options, chunks=logits.chunks)(hidden.reshape(rows, hidden.shape[-1]))
    logits.root.chunked = True
    made = getattr(_MADE, "losses", None)
    if made is not None:
        made.append((loss, head, rows))
    return loss


def _casts_to_float32(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether `tensor.func(*args, **kwargs)` only casts to float32 (`.float()`,
    `.to(torch.float32)`, `.type(torch.float32)`)."""
    if func is torch.Tensor.float:
        return not args and not kwargs
    if func is torch.Tensor.type:
        return args == (torch.float32,) and not kwargs
    return not kwargs and args == (torch.float32,) or not args and kwargs == {"dtype": torch.float32}


def _plain(x: Any) -> bool:
    """Whether `x` is a tensor of no subclass but a trace's fake tensors."""
    return isinstance(x, torch.Tensor) and (type(x) is torch.Tensor or is_fake(x))


def _computed(x: Any) -> Any:
    return x.computed() if isinstance(x, DeferredLogits) else x


def _deferred_forward(head: nn.Linear, input: Any) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
    chunks = getattr(_THIS, "heads", {}).get(id(head))
    if (chunks is None or not (_plain(input) and torch.is_grad_enabled())
            or torch.is_autocast_enabled(input.device.type)):
        return type(head).forward(head, input)
    return DeferredLogits(input, head, chunks)


@contextmanager
def deferring(heads: Sequence[nn.Linear], chunks: int) -> Iterator[list[tuple[torch.Tensor, nn.Linear, int]]]:
    """While it lasts, each of `heads` called on this thread where gradients are on,
    outside autocast, returns its logits deferred (`DeferredLogits`), a cross-entropy
    over them run in `chunks` token chunks; yields the list of the losses so computed
    (for `returned`). Once it ends, logits a chunked cross-entropy alone read are closed
    (a later read is refused), and any other not yet computed are computed."""
    _see_through_functions()
    before = dict(getattr(_THIS, "heads", {})), getattr(_MADE, "losses", None), getattr(_MADE, "roots", None)
    _THIS.heads = {**before[0], **{id(head): chunks for head in heads}}
    _MADE.losses, _MADE.roots = made, roots = [], []
    with _LOCK:
        for head in heads:
            if _DEFERRING.setdefault(head, functools.partial(_deferred_forward, head)) is not vars(head).get("forward"):
                head.forward = _DEFERRING[head]
            _USERS[head] = _USERS.get(head, 0) + 1
    try:
        yield made
    finally:
        _THIS.heads, _MADE.losses, _MADE.roots = before
        with _LOCK:
            for head in heads:
                _USERS[head] -= 1
                if not _USERS[head]:
                    del head.forward, _USERS[head], _DEFERRING[head]
        for ref in roots:
            root = ref()
            if root is not None and root.value is None:
                if root.chunked:
                    root.closed = True
                else:
                    root.computed()


def _see_through_functions() -> None:
    """Make `torch.autograd.Function.apply` hand deferred logits over computed: it calls
    no `__torch_function__`, and would take them for a leaf of their own, cutting the head
    and all before it out of the backward. Done once, on first use; other calls run as
    they did."""
    apply = vars(torch.autograd.function.Function)["apply"].__func__
    if getattr(apply, "_sees_deferred_logits", False):
        return

    def seeing(cls: type, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, DeferredLogits) for a in tree_leaves((args, kwargs))):
            args, kwargs = tree_map(_computed, args), tree_map(_computed, kwargs)
        return apply(cls, *args, **kwargs)

    seeing._sees_deferred_logits = True
    torch.autograd.function.Function.apply = classmethod(functools.wraps(apply)(seeing))


def returned(out: Any, losses: list[tuple[torch.Tensor, nn.Linear, int]]) -> Any:
    """A forward's output with its deferred logits settled: None for those only a chunked
    cross-entropy read (it never held them), the logits themselves for the rest; each
    differentiable scalar in it built on one of `losses` (a deferring forward's) is
    known to `chunked_by`."""
    settled = tree_map(lambda x: (None if x.root.chunked and x.root.value is None else x.computed())
                       if isinstance(x, DeferredLogits) else x, out)
    for leaf in tree_leaves(settled) if losses else ():
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.grad_fn is not None:
            found = _built_on(leaf, losses)
            if found is not None:
                _CHUNKED[leaf] = found
    return settled
