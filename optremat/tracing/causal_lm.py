"""A transformers causal LM's own loss with its head and loss run by `CausalLMLoss`.

Called with `labels`, a causal LM from transformers runs its base model, projects the
last hidden states with `lm_head` (all of them in training), keeps the whole logits in
its output and takes the loss over them with `loss_function`. `HeadInChunks(k)` runs that
forward with the head and loss as `CausalLMLoss` runs them in k token chunks: the base
model runs as it is, `outputs.loss` is the model's loss, and `outputs.logits` is None,
since no step holds the whole logits (as Liger Kernel's and Cut Cross-Entropy's forwards
return them). `optremat.plan` prices it by tracing the model under `running`, and
`optremat.apply` runs the planned training steps through it.

Only forwards read to have that form run so (`FORWARDS`, transformers 5), and only
while the model's forward, head and loss function are its class's own; a call that
computes no loss (no `labels`) or keeps only some positions' logits (`logits_to_keep`)
runs the model's own forward.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from optremat.tracing.extract import tracing
from optremat.tracing.inputs import call_of
from optremat.tracing.lm_loss import AUTO, CausalLMLoss, check_chunks
from optremat.tracing.repeat import MODULE_HOOKS

FORWARDS = {"GPT2LMHeadModel": None, "LlamaForCausalLM": None, "MistralForCausalLM": None, "Qwen2ForCausalLM": None,
            "Qwen3ForCausalLM": None, "GemmaForCausalLM": None, "Gemma2ForCausalLM": "final_logit_softcapping"}
"""The causal LMs of transformers 5 whose forward is `outputs = self.<base model>(<every
argument but labels and logits_to_keep>)`, `logits = self.lm_head(outputs.last_hidden_state
[:, -logits_to_keep:])`, softcapped as Gemma 2 does where a config attribute is named
here, then `self.loss_function(logits, labels, vocab_size, **kwargs)`, returned with the
base model's other outputs: by the class that defines the forward."""

_SPLIT = ("labels", "logits_to_keep")
"""The forward's arguments that do not go to the base model."""


def unsupported(model: nn.Module) -> str | None:
    """Why `model`'s own loss cannot run with its head in chunks, or None when it can."""
    reason = _unsupported_class(model)
    if reason is not None:
        return reason
    if not _runs_its_class_forward(model):
        return f"{type(model).__name__}'s forward was replaced on the model, so its class's is not what it runs"
    return _hooked(model)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _hooked(model: nn.Module) -> str | None:
    """Why hooks on `model`'s head, or on every module, keep the head from running in
    chunks, or None."""
    head = model.get_output_embeddings()
    if any(getattr(head, name) for name in MODULE_HOOKS):
        return f"{type(model).__name__}'s lm_head has hooks, which a head run in chunks would not call"
    if any(getattr(nn.modules.module, name) for name in _GLOBAL_HOOKS):
        return "a global module hook is registered, which a head run in chunks would not call on lm_head"
    return None


def own_head(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
             head_chunks: int | str | None) -> tuple[str, int] | None:
    """The head of a causal LM whose own loss a call on `example_inputs` (as
    `optremat.plan` reads them) computes, when `head_chunks` ("auto", or a count of
    token chunks) asks to run it in chunks and the call can: the name `named_parameters`
    gives its weight, and the positions its loss covers. None where the step runs as the
    model runs it: `head_chunks` None, a `loss_fn` given, or, for "auto", a model or call
    whose own loss cannot run with the head in chunks (a ValueError for a count)."""
    check_chunks(head_chunks)
    if loss_fn is not None and head_chunks not in (None, AUTO):
        raise ValueError(f"head_chunks={head_chunks!r} sets how the model's own loss runs, and loss_fn replaces it: "
                         "leave head_chunks out and set the chunks of an optremat.CausalLMLoss instead")
    if loss_fn is not None or head_chunks is None:
        return None
    reason = unsupported(model)
    if reason is None:
        try:
            args, kwargs = call_of(example_inputs)
        except TypeError:  # an input no trace can take: the trace names it
            return None
        call = _loss_call(model, args, kwargs)
        reason = None if call is not None else ("the inputs do not make the model compute its loss over every "
                                                "position (that takes labels, and no logits_to_keep)")
    if reason is not None:
        if head_chunks == AUTO:
            return None
        raise ValueError(f"head_chunks={head_chunks!r} cannot run: {reason}; leave head_chunks out to run the "
                         "model's own forward")
    weight = model.get_output_embeddings().weight
    return next(name for name, p in model.named_parameters() if p is weight), call[2].numel()


def own_chunks(model: nn.Module, chunks: int | None) -> int | None:
    """`chunks`, the token chunks a plan runs a causal LM's head in (`Plan.chunking`),
    where they are for `model`'s own head and loss: where `model` runs its class's
    forward and that is one of `FORWARDS`, since the other way to chunk a head, a
    `CausalLMLoss`, reads hidden states, which those forwards never return. None
    otherwise; a ValueError saying why where they are and the model's own loss cannot
    run with its head in chunks now (hooks on its head, another loss function)."""
    if chunks is None or not (_runs_its_class_forward(model) and _known(_defining(type(model)))):
        return None
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    return chunks


@dataclass(frozen=True)
class HeadInChunks:
    """A causal LM's forward (one of `FORWARDS`) with its head and loss run by
    `CausalLMLoss` in `chunks` token chunks ("auto": those a plan installs for the head),
    returning the forward's output with `logits` None (a tuple keeps their place, as
    None); a call that computes no loss runs the model's own forward. Called as
    `HeadInChunks(k)(model, forward, *args, **kwargs)`, `forward` being the model's own.
    `base`, given the loss the call computes, returns what runs the base model (the
    model's own `base_model` when None; a compiled one, `compile_causal_lm`). A head or
    loss changed since the plan was made (a hook added to the head, which a trace's own
    hooks are not) runs the model's own forward too, with a warning."""

    chunks: int | str
    base: Callable[[CausalLMLoss], Callable[..., Any]] | None = None

    def __call__(self, model: nn.Module, forward: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        call = _loss_call(model, args, kwargs)
        reason = None if call is None else _unsupported_class(model) or (None if tracing() else _hooked(model))
        if reason is not None:
            warnings.warn(f"optremat: {reason}: the model's own head and loss run whole, as unplanned (the step's "
                          "memory is not the plan's)", stacklevel=3)
        if call is None or reason is not None:
            return forward(*args, **kwargs)
        arguments, extra, labels = call
        passed = extra.pop("return_dict", None)  # as transformers' can_return_tuple reads it
        return_dict = getattr(model.config, "return_dict", True) if passed is None else passed
        softcap = FORWARDS[_defining(type(model)).__name__]
        loss_fn = CausalLMLoss(model.get_output_embeddings(), labels, ignore_index=extra.get("ignore_index", -100),
                               shift=extra.get("shift_labels") is None,
                               num_items_in_batch=extra.get("num_items_in_batch"),
                               softcap=None if softcap is None else getattr(model.config, softcap, None),
                               chunks=self.chunks)
        outputs = (model.base_model if self.base is None else self.base(loss_fn))(**arguments, **extra)
        loss = loss_fn(outputs.last_hidden_state)
        result = _signature(type(model)).return_annotation
        kept = {f.name: getattr(outputs, f.name, None) for f in fields(result) if f.name not in ("loss", "logits")}
        output = result(loss=loss, logits=None, **kept)
        return output if return_dict else (loss, None, *output.to_tuple()[1:])  # logits' place kept, as None


@contextmanager
def running(model: nn.Module, chunks: int | None) -> Iterator[None]:
    """While it lasts (a trace), `model(...)` runs its head and loss in `chunks` token
    chunks (`HeadInChunks`); None leaves the model as it is."""
    if chunks is None:
        yield
        return
    before = model.__dict__.get("forward")
    model.forward = functools.partial(HeadInChunks(chunks), model, model.forward)
    try:
        yield
    finally:
        if before is None:
            del model.forward
        else:
            model.forward = before


def _unsupported_class(model: nn.Module) -> str | None:
    """Why `model`'s class, head or loss function keeps its own loss from running with its
    head in chunks, or None (hooks are checked apart, `_hooked`: a trace adds its own)."""
    name = type(model).__name__
    defining = _defining(type(model))
    if not _known(defining):
        return (f"{name} runs {defining.__qualname__}.forward, and the causal LMs whose own loss runs with the head "
                f"in chunks are transformers' {', '.join(FORWARDS)}")
    transformers = sys.modules["transformers"]
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"{name}'s forward in transformers {transformers.__version__} is not the one read; transformers 5 has it"
    signature = _signature(type(model))
    result = signature.return_annotation
    if (not all(p in signature.parameters for p in _SPLIT) or not is_dataclass(result)
            or not {"loss", "logits"} <= {f.name for f in fields(result)}):
        return f"{name}'s forward does not take labels and logits_to_keep and return loss and logits"
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        return f"{name}'s loss_function is not transformers' ForCausalLMLoss"
    if type(model.get_output_embeddings()) is not nn.Linear:
        return f"{name}'s lm_head is not an nn.Linear"
    return None


def _loss_call(model: nn.Module, args: tuple, kwargs: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor] | None:
    """A call's arguments for the base model (named, and those the forward takes as
    `**kwargs`, which go to the loss function too) and the labels its loss is taken
    against, when the call computes a loss over every position; None otherwise, or when
    the forward does not take the call (its own forward then says why)."""
    signature = _signature(type(model))
    try:
        bound = signature.bind(model, *args, **kwargs).arguments
    except TypeError:
        return None
    parameters = list(signature.parameters.values())
    var = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = dict(bound.get(var, {}))
    arguments = {k: v for k, v in bound.items() if k not in (parameters[0].name, var, *_SPLIT)}
    labels, keep = bound.get("labels"), bound.get("logits_to_keep", 0)
    if labels is None or not (isinstance(keep, int) and keep == 0):
        return None
    shifted = extra.get("shift_labels")
    return arguments, extra, labels if shifted is None else shifted


def _defining(cls: type) -> type:
    """The class in `cls`'s MRO whose `forward` its instances run."""
    return next(c for c in cls.__mro__ if "forward" in vars(c))


def _known(defining: type) -> bool:
    """Whether `defining` is a transformers class whose forward is one of `FORWARDS`."""
    return defining.__module__.startswith("transformers.models.") and defining.__name__ in FORWARDS


def _runs_its_class_forward(model: nn.Module) -> bool:
    """Whether a call of `model` runs its class's forward, not one set on the model."""
    forward = model.__dict__.get("forward")
    forward = getattr(forward, "replaced", forward)  # an installed plan's forward stands for the one it replaced
    return forward is None or getattr(forward, "__func__", None) is type(model).forward


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """The signature of the forward `cls` runs, through its decorators."""
    return inspect.signature(cls.forward)
