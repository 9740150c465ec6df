"""A transformers causal LM compiled with its own loss, its LM head in planned chunks.

Compiled whole, a causal LM's step computes its logits inside the graph and returns them,
so no plan can run its head in chunks. `compile_causal_lm` compiles the base model
instead and runs the head and loss after it, as `CausalLMLoss(chunks="auto")` over the
final hidden states: the loss between the compiled forward and backward that
`compile_backend` prices whole and in each count of token chunks, choosing the count with
the plan (`Partitioner._chunked`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from optremat.compiler.backend import Backend, Partitioner
from optremat.runtime import native
from optremat.tracing import causal_lm
from optremat.tracing.fingerprint import model_fingerprint
from optremat.tracing.lm_loss import AUTO, CausalLMLoss


@dataclass(eq=False)
class CompiledBase:
    """A causal LM's base model compiled under a `Partitioner`: called with the loss a
    step computes on its hidden states, it makes that the loss the partitioner plans
    with and returns the compiled base model."""

    partitioner: Partitioner
    compiled: Callable[..., Any]

    def __call__(self, loss_fn: CausalLMLoss) -> Callable[..., Any]:
        self.partitioner.loss_fn = loss_fn
        return self.compiled


def compile_causal_lm(model: nn.Module, backend: Backend) -> nn.Module:
    """`model`, a transformers causal LM (one of `causal_lm.FORWARDS`), with its training
    steps compiled by `backend` and its own loss run as planned; returned.

    A training call given `labels` (the model in training mode, gradients on) runs the
    base model compiled (`torch.compile(model.base_model, backend=backend,
    dynamic=False)`), then the head and the model's loss in the token chunks the plan
    chooses (`outputs.logits` is then None); a fractional budget is of the step with the
    whole head. Other calls run the model's own forward, uncompiled.
    `optremat.remove(model)` takes it off. The state dict is the model's own."""
    if not isinstance(backend, Backend):
        raise TypeError(f"compile_causal_lm needs a backend from optremat.compile_backend, not "
                        f"{type(backend).__name__}")
    if backend.partitioner.loss_fn is not None:
        raise ValueError("this backend prices a loss_fn of its own; the model's loss is the one run after its base "
                         "model: make the backend without loss_fn")
    if not isinstance(model, nn.Module) or causal_lm.unsupported(model) is not None:
        reason = causal_lm.unsupported(model) if isinstance(model, nn.Module) else f"{type(model).__name__} is no model"
        raise ValueError(f"compile_causal_lm runs a transformers causal LM's own loss after its compiled base model, "
                         f"and {reason}")
    compiled = CompiledBase(backend.partitioner, torch.compile(model.base_model, backend=backend, dynamic=False))
    return native.install(model, (), training=True, fingerprint=model_fingerprint(model),
                          forward=causal_lm.HeadInChunks(AUTO, compiled))
