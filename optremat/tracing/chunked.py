"""The LM head and its cross-entropy run in token chunks, so only one chunk's logits live.

Two implementations, both taking the gradients in the forward (each chunk's logits are
made, turned into their gradient and dropped; the backward only scales the gradients by
the loss's own), so neither recomputes a logit:

- PyTorch's `F.linear_cross_entropy` with `LinearCrossEntropyOptions(batch_chunk_size=...)`
  covers the plain loss on an accelerator. Its chunked path is one custom op
  (`torch_nn::_linear_cross_entropy_batch_chunked`) whose fake kernel reports only its
  outputs, so a trace would not see the chunk's logits it allocates; `DECOMPOSITIONS`
  lets a trace record the op's own Python implementation instead, op by op, so that
  every buffer it allocates is priced as it runs.
- `ChunkedCrossEntropy`, ours, covers what PyTorch's chunked path refuses (it falls back
  to the whole logits for label smoothing) or cannot express (Gemma 2's final logit
  softcapping), any loss on a CPU (where it is faster, `EXP_FLOOR`), and any loss when
  the PyTorch version lacks the implementation a trace records (`TORCH_CHUNKED`). Its
  ops trace as they are.

Both loops run every chunk alike but the last, so a trace runs only five of them
(`loops_shortened`) and copies the fourth for the others (`tracing.chunk_copies`): a
Llama-7B's 128-chunk loop took 6 s of tracing, 36 ops a chunk.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

try:
    from torch.nn.modules.linear_cross_entropy import _linear_cross_entropy_batch_chunked_accumulator as _accumulate
except ImportError:  # another PyTorch: the plain loss runs in our chunks too
    _accumulate = None
try:
    from torch.nn.modules.linear_cross_entropy import _ChunkContext
except ImportError:  # another PyTorch: its loop is traced whole
    _ChunkContext = None

TORCH_CHUNKED = _accumulate is not None and hasattr(torch.nn, "LinearCrossEntropyOptions")
"""Whether PyTorch's chunked linear_cross_entropy can run the plain loss here and be
priced op by op (the implementation behind its custom op is where a trace finds it)."""


def _batch_chunked(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                   linear_bias: torch.Tensor | None, weight: torch.Tensor | None, reduction: str, ignore_index: int,
                   label_smoothing: float, batch_chunk_size: int, acc_policy: str, acc_dtype: torch.dtype,
                   allow_retain_graph: bool, compute_input_grad: bool, compute_linear_weight_grad: bool,
                   compute_linear_bias_grad: bool) -> tuple[torch.Tensor, ...]:
    """The custom op's forward as its eager kernel runs it (`allow_retain_graph` only
    changes its backward)."""
    return _accumulate(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
                       batch_chunk_size, acc_policy, acc_dtype, compute_input_grad, compute_linear_weight_grad,
                       compute_linear_bias_grad)


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = (
    {torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default: _batch_chunked} if TORCH_CHUNKED else {})
"""What a trace records in place of an opaque op, so that its temporaries are priced."""


KEPT_CHUNKS = (0, 1, 2, 3, -1)
"""The chunks a shortened loop runs: the first four and the last (which may be shorter).
The first also builds what the loop makes on first use and every chunk reads (PyTorch's
loop makes its targets and weights so), the third and fourth show whether chunks repeat."""
MIN_CHUNKS = 8
"""Loops of fewer chunks run whole: five are traced either way."""

_SHORT = threading.local()
"""While a trace on this thread shortens chunk loops: `mark`, called with each chunk's
index as it starts and with None after the loop."""
_INSTALLING = threading.Lock()
SHORTENED_TORCH = "2.13."
"""The PyTorch whose chunk loop `_shortened_chunks` repeats; under another, its loop is
traced whole."""


@contextmanager
def loops_shortened(mark: Callable[[int | None], None]) -> Iterator[None]:
    """While it lasts, chunk loops on fake tensors on this thread run only the chunks
    `KEPT_CHUNKS` (all, where there are fewer than `MIN_CHUNKS`), calling `mark(i)` as
    chunk i starts and `mark(None)` after the loop: a trace then copies the fourth chunk's
    ops for the chunks left out. Eager loops, and other threads', run every chunk."""
    _install()
    outer, _SHORT.mark = getattr(_SHORT, "mark", None), mark
    try:
        yield
    finally:
        _SHORT.mark = outer


def chunk_indices(count: int, tensor: torch.Tensor) -> Iterator[int]:
    """The chunks of a loop over `count` chunks of `tensor` to run (see `loops_shortened`)."""
    mark = getattr(_SHORT, "mark", None)
    if not _shortening(tensor) or count < MIN_CHUNKS:
        yield from range(count)
        return
    try:
        for i in KEPT_CHUNKS:
            mark(i % count)
            yield i % count
    finally:
        mark(None)


def _chunks(self: Any) -> Iterator[Any]:
    """PyTorch's chunk loop (`_ChunkContext.chunks`), or in a loop `loops_shortened`
    shortens, its 2.13 form over the chunks `chunk_indices` runs."""
    return _shortened_chunks(self) if _shortening(self.input) else _TORCH_CHUNKS(self)


def _shortening(tensor: torch.Tensor) -> bool:
    """Whether a loop over `tensor` runs in a trace shortening it."""
    return getattr(_SHORT, "mark", None) is not None and is_fake(tensor)


def _shortened_chunks(self: Any) -> Iterator[Any]:
    """PyTorch 2.13's `_ChunkContext.chunks` over the chunks `chunk_indices` runs."""
    rows = self.logits_buf.shape[0]
    for i in chunk_indices(-(-self.num_batches // rows), self.input):
        start = i * rows
        chunk = self.bind_chunk(start, min(rows, self.num_batches - start))
        yield chunk
        if self.alloc_input_grad_acc_buf:
            self.grad_input.narrow(0, start, chunk.bchunk_size).copy_(chunk.grad_input_chunk)
        if self.alloc_linear_bias_grad_chunk:
            self.grad_linear_bias.add_(chunk.bias_grad_acc.to(self.grad_linear_bias.dtype))
            chunk.bias_grad_acc.zero_()


_TORCH_CHUNKS = None if _ChunkContext is None else _ChunkContext.chunks


def _install() -> None:
    """Make PyTorch's chunk loop ask whether a trace shortens it (once, on the PyTorch
    whose loop `_shortened_chunks` repeats)."""
    with _INSTALLING:
        if _ChunkContext is not None and _ChunkContext.chunks is _TORCH_CHUNKS \
                and torch.__version__.startswith(SHORTENED_TORCH):
            _ChunkContext.chunks = _chunks


EXP_FLOOR = -64.0
"""Where a chunk's shifted logits are cut off before `exp`. x86 CPUs compute float32
denormals 10-40x slower: `exp` below about -87 yields one, and so does a small
probability once scaled by 1 / tokens and multiplied into the matmuls (a wide-logit
model's 2-chunk loss measured 110 ms per `exp_` instead of 3 ms). e^-64 is 1.6e-28:
added to a softmax sum of at least 1 it changes no float32 bit, and the gradient
entries it leaves are 1e-28 from the unclipped ones."""


class ChunkedCrossEntropy(torch.autograd.Function):
    """`sum(cross_entropy(softcap(linear(hidden, weight, bias)).float(), labels)) / denominator`
    over rows `rows` at a time, with `ignore_index` rows left out and `label_smoothing` as
    `F.cross_entropy` applies it; `softcap` None or c for c * tanh(logits / c).

    The forward holds one chunk's float32 logits (with softcap also their capped tanh,
    in the head's dtype, for the cap's backward) and builds the gradients of hidden,
    weight and bias as it goes; the backward scales them by the loss's gradient in
    place, or into new tensors where the graph is kept for another backward
    (`retain_graph`). Its gradients have no gradients themselves (no double backward)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, rows: int, ignore_index: int, label_smoothing: float,
                softcap: float | None, denominator: torch.Tensor) -> torch.Tensor:
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        valid = labels != ignore_index
        target = torch.where(valid, labels, 0)
        scale = torch.where(valid, 1 / denominator, 0.0).to(torch.float32)  # no 0/0 where every label is ignored
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        for i in chunk_indices(-(-hidden.shape[0] // rows), hidden):
            part = slice(i * rows, (i + 1) * rows)
            total += _chunk(hidden[part], weight, bias, target[part, None], scale[part, None], label_smoothing,
                            softcap, None if grad_hidden is None else grad_hidden[part], grad_weight, grad_bias)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(bias.dtype), valid)
        return total / (denominator != 0)  # every label ignored: F.cross_entropy's nan, and gradients 0 as its

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("optremat: the LM head's loss run in token chunks computes its gradients in the "
                               "forward and has no second derivative, so a backward with create_graph=True "
                               "(a gradient penalty) cannot run through it; plan with head_chunks=None (or "
                               "CausalLMLoss(chunks=None)) to run the head whole")
        scale = torch.mul if torch._C._autograd._get_current_graph_task_keep_graph() else torch.Tensor.mul_
        grad_hidden, grad_weight, grad_bias, valid = ctx.saved_tensors
        # an ignored row's gradients are none, not 0 times the loss's: an infinite one (a summed
        # loss over no label, divided by a count of 0) leaves them 0, as F.cross_entropy does
        by_any = torch.where(valid.any(), grad_loss, 0)
        by_row = None if grad_hidden is None else torch.where(valid[:, None], grad_loss, 0).to(grad_hidden.dtype)
        grads = [None if g is None else scale(g, by) for g, by in
                 ((grad_hidden, by_row), (grad_weight, by_any), (grad_bias, by_any))]
        return (*grads, None, None, None, None, None, None)


def refuse_out_of_range(labels: torch.Tensor, ignore_index: int, classes: int) -> None:
    """Stop on a counted label outside the vocabulary, as `F.cross_entropy` does: on a
    CPU with its IndexError, on an accelerator with an assert on the device (no wait for
    it). Both chunked losses' gathers fail naming neither the label nor the vocabulary,
    or read past a row."""
    if is_fake(labels) or labels.is_meta or torch.compiler.is_compiling():
        return
    wrong = (labels != ignore_index) & ((labels < 0) | (labels >= classes))
    if labels.device.type != "cpu":
        torch._assert_async(~wrong.any(), f"a label is out of bounds for the {classes} classes")
    elif wrong.any():
        raise IndexError(f"Target {labels[wrong][0].item()} is out of bounds: labels must lie in [0, {classes}) or "
                         "equal ignore_index")


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
           scale: torch.Tensor, label_smoothing: float, softcap: float | None, grad_hidden: torch.Tensor | None,
           grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's share of the loss, its gradients written into `grad_hidden` and added
    to `grad_weight` and `grad_bias`. Its logits die when it returns, as a trace prices
    them: a loop body holding them in its variables would keep the last chunk's until the
    next chunk's exist."""
    logits = F.linear(hidden, weight, bias)
    capped = None
    if softcap is not None:  # in the logits' own dtype, as Gemma 2 caps them
        capped = logits.div_(softcap).tanh_()
        logits = capped * softcap
    logits = logits.float()
    picked = logits.gather(1, target)[:, 0]
    mean = logits.mean(1) if label_smoothing else None
    top = logits.amax(1)
    grad = logits.sub_(top[:, None]).clamp_min_(EXP_FLOOR).exp_()  # softmax in place: logsumexp would hide a copy
    del logits  # the same storage as grad, which a cap's backward casts: the float32 one dies then, as priced
    total = grad.sum(1)
    grad.div_(total[:, None])
    lse = top + total.log()
    loss = lse - picked
    if mean is not None:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - mean)
        grad.sub_(label_smoothing / weight.shape[0])
    grad.scatter_add_(1, target, torch.full(target.shape, label_smoothing - 1, dtype=grad.dtype, device=grad.device))
    grad.mul_(scale)
    if capped is not None:  # the cap's backward, op by op in the logits' dtype, as autograd runs it
        grad = grad.to(capped.dtype).mul_(softcap)
        torch.ops.aten.tanh_backward.grad_input(grad, capped, grad_input=grad).div_(softcap)
        capped = None  # freed before the matmuls, as a trace prices it
    if grad_hidden is not None:
        torch.mm(grad.to(hidden.dtype), weight, out=grad_hidden)
    if grad_weight is not None:
        grad_weight.addmm_(grad.t().float(), hidden.float())
    if grad_bias is not None:
        grad_bias += grad.sum(0, dtype=torch.float32)
    return (loss * scale[:, 0]).sum()
