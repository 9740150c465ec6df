"""A transformers causal LM compiled with its own loss, its LM head in planned chunks.

Compiled whole, a causal LM's step computes its logits inside the graph and returns them,
so no plan can run its head in chunks. `compile_causal_lm` compiles the base model
instead and runs the head and loss after it, as `CausalLMLoss(chunks="auto")` over the
final hidden states: the loss between the compiled forward and backward that
`compile_backend` prices whole and in each count of token chunks, choosing the count with
the plan (`Partitioner._chunked`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from optremat.compiler.backend import Backend
from optremat.runtime import native
from optremat.tracing import causal_lm
from optremat.tracing.fingerprint import model_fingerprint
from optremat.tracing.lm_loss import AUTO, CausalLMLoss, install


@dataclass(eq=False)
class CompiledBase:
    """A causal LM's base model compiled by `backend`: called with the loss a step
    computes on its hidden states, it returns what runs the compiled base model with that
    loss the one the backend's partitioner plans with (while it runs: it compiles there),
    and installs for the loss's head the chunks planned for its labels' shape (`chosen`; a
    shape compiled later must not change an earlier one's). The compiled module is made
    on first use and left out of copies, so a copied model compiles its own base model."""

    base: nn.Module
    backend: Backend
    chosen: dict[tuple[int, ...], int | None] = field(default_factory=dict)
    compiled: Callable[..., Any] | None = None

    def __call__(self, loss_fn: CausalLMLoss) -> Callable[..., Any]:
        return functools.partial(self._run, loss_fn)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "compiled": None}

    def _run(self, loss_fn: CausalLMLoss, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            self.compiled = torch.compile(self.base, backend=self.backend, dynamic=False)
        partitioner = self.backend.partitioner
        made = len(partitioner.plans)
        partitioner.loss_fn = loss_fn
        try:
            out = self.compiled(*args, **kwargs)
        finally:
            partitioner.loss_fn = None
        shape = tuple(loss_fn.labels.shape)
        chunked = [plan.chunking for plan in partitioner.plans[made:] if plan.chunking is not None]
        if chunked:
            self.chosen[shape] = chunked[-1].chunks
        if shape in self.chosen:
            install(loss_fn.weights(substituted=False)[0], self.chosen[shape])
        return out


def compile_causal_lm(model: nn.Module, backend: Backend) -> nn.Module:
    """`model`, a transformers causal LM (of a form in `causal_lm.TEMPLATES`), with its training
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
    reason = causal_lm.unsupported(model) if isinstance(model, nn.Module) else f"{type(model).__name__} is no model"
    if reason is not None:
        raise ValueError(f"compile_causal_lm runs a transformers causal LM's own loss after its compiled base model, "
                         f"and {reason}")
    return native.install(model, (), training=True, fingerprint=model_fingerprint(model),
                          forward=causal_lm.HeadInChunks(AUTO, CompiledBase(model.base_model, backend)))
