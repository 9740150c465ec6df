"""`CausalLMLoss`: a causal language model's head and cross-entropy, whole or in token chunks.

The LM head's logits (tokens x vocabulary, with their float32 copy and gradient) set the
least peak any activation plan of a language model reaches. Run in k token chunks, only
one chunk's logits live at once. How many chunks is a decision `optremat.plan` prices with
the rest of the plan (`chunks="auto"`); `optremat.apply` installs the chosen count where
the loss finds it (`install`), keyed by the head's weight, so the same loss object, or
any other over that head, runs as planned.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from optremat.tracing.chunked import TORCH_CHUNKED, ChunkedCrossEntropy, refuse_out_of_range

AUTO = "auto"
"""`chunks` left to the plan: whole until a plan applied to the model says otherwise."""

_INSTALLED = WeakIdKeyDictionary()
"""Head weight -> chunk count of the plan applied to the model holding it."""

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)

_STANDING_IN = threading.local()
"""While a step is traced on this thread: id of each model parameter -> the traced tensor standing for it."""


@dataclass(frozen=True, eq=False)
class CausalLMLoss:
    """`loss_fn(out)`: cross-entropy of `head`'s logits over the hidden states `out`
    against `labels`, as transformers computes a causal LM's loss.

    `out` is what the model returns: the final hidden states [..., T, H], or an object
    with `.last_hidden_state`, or a tuple whose first element they are. `head` is the
    output projection: an `nn.Linear` (its bias is used), any module with a [V, H]
    `weight` (an `nn.Embedding`, for tied embeddings), or a [V, H] weight tensor
    (`bias`, a [V] tensor, only with a tensor head). `labels` [..., T] holds token ids;
    with `shift` position t predicts label t+1 (the labels are shifted, not the hidden
    states, so no copy of them is made; the last position predicts nothing).
    Positions labelled `ignore_index` count for nothing. The loss is the mean over the
    counted positions, or the sum over `num_items_in_batch` when given (as transformers
    averages over a whole gradient-accumulation batch). `label_smoothing` is
    `F.cross_entropy`'s; `softcap` c applies c * tanh(logits / c) to the logits in the
    head's dtype, before they are cast to float32 (Gemma 2's final logit softcapping,
    which caps bfloat16 logits in bfloat16).

    `chunks` None computes the whole logits, `F.cross_entropy(F.linear(h, W, b).float())`;
    k runs the head and loss in k token chunks, gradients taken in the forward
    (PyTorch's `F.linear_cross_entropy` for the plain loss on an accelerator,
    `ChunkedCrossEntropy` on a CPU and for label smoothing and softcap); "auto" (the default)
    is for `optremat.plan` to choose, and runs whole until a plan applied to the model
    holding the head chose otherwise.
    """

    head: nn.Module | torch.Tensor
    labels: torch.Tensor
    bias: torch.Tensor | None = None
    ignore_index: int = -100
    shift: bool = True
    label_smoothing: float = 0.0
    num_items_in_batch: int | torch.Tensor | None = None
    softcap: float | None = None
    chunks: int | str | None = AUTO

    def __post_init__(self) -> None:
        if isinstance(self.head, nn.Module):
            weight = getattr(self.head, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise TypeError(f"head must hold a 2-D weight [vocabulary, hidden] (an nn.Linear or nn.Embedding), "
                                f"not {type(self.head).__name__}")
            if self.bias is not None:
                raise ValueError("bias goes with a weight tensor head; a module head's own bias is used")
        elif not isinstance(self.head, torch.Tensor) or self.head.dim() != 2:
            raise TypeError("head must be an nn.Linear, a module with a [vocabulary, hidden] weight, or such a "
                            f"weight tensor, not {type(self.head).__name__}")
        if not isinstance(self.labels, torch.Tensor) or self.labels.is_floating_point() or self.labels.is_complex():
            raise TypeError("labels must be a tensor of token ids (an integer dtype)")
        check_chunks(self.chunks)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], not {self.label_smoothing!r}")
        if self.softcap is not None and not (isinstance(self.softcap, numbers.Real) and self.softcap > 0):
            raise ValueError(f"softcap must be None or a number > 0, not {self.softcap!r}")
        items = self.num_items_in_batch
        if items is not None and not isinstance(items, torch.Tensor) and (
                isinstance(items, bool) or not isinstance(items, numbers.Integral) or items < 1):
            raise ValueError(f"num_items_in_batch must be None, a whole number >= 1 or a tensor, not {items!r}")

    def __call__(self, out: Any) -> torch.Tensor:
        hidden = hidden_states(out, self.labels.shape)
        if hidden.shape[:-1] != self.labels.shape:
            raise ValueError(f"labels of shape {list(self.labels.shape)} do not match the hidden states "
                             f"{list(hidden.shape)}: labels must have the hidden states' shape without the last "
                             "dimension")
        weight, bias = self.weights()
        labels = self.labels.to(hidden.device)
        if self.shift:
            labels = F.pad(labels[..., 1:], (0, 1), value=self.ignore_index)
        flat, target = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        chunks = self.running_chunks()
        if chunks is None:
            return self._whole(flat, weight, bias, target)
        refuse_out_of_range(target, self.ignore_index, weight.shape[0])
        rows = math.ceil(flat.shape[0] / chunks)
        denominator = (torch.as_tensor(self.num_items_in_batch, device=flat.device)
                       if self.num_items_in_batch is not None else (target != self.ignore_index).sum())
        if TORCH_CHUNKED and not self.label_smoothing and self.softcap is None and _torch_kernel_runs(flat):
            options = nn.LinearCrossEntropyOptions(batch_chunk_size=rows, chunking_method=None)
            total = F.linear_cross_entropy(flat, weight, target, linear_bias=bias, ignore_index=self.ignore_index,
                                           reduction="sum", options=options)
            # over no label its gradients are 0 whatever reaches them, as F.cross_entropy's: PyTorch's
            # kernel scales them by the loss's gradient, nan where that is infinite (a count of 0 after)
            total = torch.where((target != self.ignore_index).any(), total, 0.0)
            counted = denominator != 0  # every label ignored: F.cross_entropy's nan, and gradients 0 as its
            return total * torch.where(counted, 1 / denominator, 0.0) + torch.where(counted, 0.0, torch.nan)
        return ChunkedCrossEntropy.apply(flat, weight, bias, target, rows, self.ignore_index, self.label_smoothing,
                                         self.softcap, denominator)

    def _whole(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               target: torch.Tensor) -> torch.Tensor:
        """The reference: the whole logits in float32."""
        logits = F.linear(hidden, weight, bias)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        logits = logits.float()
        if self.num_items_in_batch is None:
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index,
                                   label_smoothing=self.label_smoothing)
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                               reduction="sum") / self.num_items_in_batch

    def weights(self, substituted: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's weight and bias as they are now (a module head's are read at each
        call, so they follow the module); while a step is traced, the traced tensors
        standing for them (`substituted`)."""
        if isinstance(self.head, nn.Module):
            found = self.head.weight, getattr(self.head, "bias", None)
        else:
            found = self.head, self.bias
        if not substituted:
            return found
        stand_ins = getattr(_STANDING_IN, "map", {})
        return tuple(None if t is None else stand_ins.get(id(t), t) for t in found)  # type: ignore[return-value]

    def running_chunks(self) -> int | None:
        """The token chunks a call runs in now (None: whole): `chunks`, or for "auto" those
        of the plan applied to the model holding the head."""
        return _INSTALLED.get(self.weights(substituted=False)[0]) if self.chunks == AUTO else self.chunks

    def with_chunks(self, chunks: int | None) -> "CausalLMLoss":
        """The same loss run whole (None) or in `chunks` token chunks."""
        return replace(self, chunks=chunks)

    def tokens(self) -> int:
        """Positions the head runs over: one per label."""
        return self.labels.numel()


def _torch_kernel_runs(hidden: torch.Tensor) -> bool:
    """Whether the plain loss's chunks run in PyTorch's kernel: on an accelerator. On a
    CPU they run in `ChunkedCrossEntropy`, which traces as it runs. There PyTorch's
    kernel is slower than the whole head (its `exp` computes denormals for a wide-logit
    model's chunks: gpt-mini's step with 2 chunks measured 1.5x the whole head's, with
    ours 0.9x) and, in bfloat16, casts the head's weight to float32 once per chunk where
    the implementation a trace records casts it once (1.27x the traced peak)."""
    return hidden.device.type != "cpu"


def cross_entropy_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`F.cross_entropy`'s arguments by name, defaults filled in, of a call given `args`
    and `kwargs`."""
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def loss_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """The options of `CausalLMLoss` (labels not shifted) that compute `F.cross_entropy`
    called with the arguments `given` (`cross_entropy_arguments`) over one row of
    logits per position: None where it has class weights, a reduction other than mean
    or sum, an ignore_index not a Python int, or a label_smoothing not a real number
    (a tensor's is left to the whole head)."""
    smoothing = given["label_smoothing"]
    if (given["weight"] is not None or given["size_average"] is not None or given["reduce"] is not None
            or given["reduction"] not in ("mean", "sum") or type(given["ignore_index"]) is not int
            or not isinstance(smoothing, numbers.Real) or isinstance(smoothing, bool)):
        return None
    return dict(ignore_index=given["ignore_index"], shift=False, label_smoothing=float(smoothing),
                num_items_in_batch=1 if given["reduction"] == "sum" else None)


def check_chunks(chunks: Any) -> None:
    """Refuse a `chunks` that is not None, "auto" or a whole number >= 1."""
    if chunks is None or chunks == AUTO:
        return
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ValueError(f"chunks must be None (whole), a whole number of token chunks >= 1, or {AUTO!r}, "
                         f"not {chunks!r}")


def hidden_states(out: Any, tokens: torch.Size | None = None) -> torch.Tensor:
    """The final hidden states in a model's output: the tensor itself, its
    `.last_hidden_state`, or in a tuple or list its first element, unless that is not of
    `tokens`' shape but for a last dimension and one other element is (a compiled graph
    returns a model's outputs flat, a mixture of experts' router logits among them, in
    an order of its own); a ValueError where several others are and none can be told."""
    found = getattr(out, "last_hidden_state", None)
    if found is None and isinstance(out, (tuple, list)) and out:
        found = out[0]
        fits = [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point() and tokens is not None
                and t.shape[:-1] == tokens]
        if tokens is not None and fits and not (isinstance(found, torch.Tensor) and found.shape[:-1] == tokens):
            if len(fits) > 1:
                raise ValueError(f"CausalLMLoss is handed {len(out)} outputs, {len(fits)} of them shaped as hidden "
                                 "states for the labels and none first: it cannot tell which are the final hidden "
                                 "states (return them first, or leave out output_hidden_states)")
            found = fits[0]
    found = out if found is None else found
    if not isinstance(found, torch.Tensor) or not found.is_floating_point() or found.dim() < 2:
        raise TypeError("CausalLMLoss needs the model's final hidden states [..., tokens, hidden]: a floating-point "
                        "tensor, or an output with .last_hidden_state or them first, "
                        f"not {type(found).__name__}")
    return found


@contextmanager
def standing_in(stand_ins: dict[int, torch.Tensor]) -> Iterator[None]:
    """While tracing: a head weight that is a model parameter (by `id`) reads as the
    traced tensor standing for it, so its gradient is traced with the model's."""
    before = getattr(_STANDING_IN, "map", {})
    _STANDING_IN.map = {**before, **stand_ins}
    try:
        yield
    finally:
        _STANDING_IN.map = before


def install(weight: torch.Tensor, chunks: int | None) -> None:
    """Make every "auto" CausalLMLoss over the head `weight` run in `chunks` token chunks."""
    _INSTALLED[weight] = chunks


def uninstall(weights: list[torch.Tensor]) -> None:
    """Let "auto" losses over these heads run whole again."""
    for weight in weights:
        _INSTALLED.pop(weight, None)
