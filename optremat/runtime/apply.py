"""`apply(model, plan)` and `remove(model)`: a model trained under a plan, and back."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from optremat.extract import trace
from optremat.fingerprint import model_fingerprint
from optremat.plan import Plan
from optremat.runtime import native
from optremat.runtime.exact import exact_program
from optremat.runtime.native import PlanMismatch
from optremat.runtime.ops import autocast_state, signature_of


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """`model` with `plan` applied: same call signature, parameters and gradients.

    A native plan is installed on `model` itself (its checkpointed module calls run under
    checkpoint; everything else is untouched) and `model` is returned; `remove(model)`
    takes it off again. An exact plan returns a wrapper that runs the traced step."""
    if not isinstance(plan, Plan):
        raise TypeError(f"apply needs an optremat Plan, not {type(plan).__name__}")
    if plan.runtime == "compiled":
        raise ValueError("this plan partitions a torch.compile graph and runs there: compile the model with "
                         "optremat.compile_backend instead of applying it")
    if plan.runtime == "exact":
        return Planned(model, plan)
    return native.install(model, plan.regions, training=plan.training, fingerprint=plan.model_fingerprint,
                          mutated_buffers=plan.mutated_buffers)


def remove(model: nn.Module) -> nn.Module:
    """Take an installed native plan off `model`; returns `model`, as it was before `apply`."""
    return native.remove(model)


class Planned(nn.Module):
    """`model` run under an exact plan for training steps, and plainly otherwise.

    Parameters and buffers are the model's own (shared, not copied), so any optimizer,
    `state_dict` and `load_state_dict` work as on the model, with the same keys. The plan
    runs only when autograd is recording and the model is in the mode and the inputs have
    the shapes it was planned for; anything else (eval mode, `torch.no_grad()`, another
    batch shape) runs the model itself, with a warning for a new shape.
    """

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self._program: Any = None
        self._warned = False

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled() or self.model.training != self.plan.training:
            return self.model(*args)
        leaves = tree_leaves(args)
        if self._program is None:
            self._program = self._trace(args)
        signature = signature_of(leaves)
        if signature != self._program.signature or autocast_state() != self._program.autocast:
            if not self._warned:
                warnings.warn("optremat: inputs or autocast differ from those the exact plan was made for "
                              f"({_describe(signature)} {autocast_state()} vs {_describe(self._program.signature)} "
                              f"{self._program.autocast}); running the model unplanned", stacklevel=2)
                self._warned = True
            return self.model(*args)
        params = dict(self.model.named_parameters())
        values = list(params.values()) + list(dict(self.model.named_buffers()).values()) + leaves
        return self._program.run(list(params), values)

    def _trace(self, args: tuple) -> Any:
        traced = self.plan.traced or trace(self.model, args)
        if (model_fingerprint(self.model) != self.plan.model_fingerprint
                or not _same_step(traced.graph, self.plan.graph)):
            raise PlanMismatch("this plan was made for another model or input shape (fingerprint "
                               f"{self.plan.graph.fingerprint}, these inputs give {traced.graph.fingerprint}); "
                               "plan again")
        return exact_program(self.model, traced, args, self.plan.graph, self.plan.schedule, dict(self.plan.shared))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)


def _same_step(traced: Any, planned: Any) -> bool:
    """The planned graph holds the traced step's ops and tensor types, perhaps reordered."""
    return sorted(zip(traced.names, traced.ops, traced.tensor)) == sorted(zip(planned.names, planned.ops, planned.tensor))


def _describe(signature: list[Any]) -> str:
    return ", ".join(f"{str(s[1]).removeprefix('torch.')}{list(s[0])}" if isinstance(s, tuple) else repr(s)
                     for s in signature)
