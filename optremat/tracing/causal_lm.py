"""A transformers causal LM's own loss with its head and loss run by `CausalLMLoss`.

Called with `labels`, a causal LM from transformers runs its base model, projects the
last hidden states with `lm_head` (all of them in training), keeps the whole logits in
its output and takes the loss over them with `loss_function`. `HeadInChunks(k)` runs that
forward with the head and loss as `CausalLMLoss` runs them in k token chunks: the base
model runs as it is, `outputs.loss` is the model's loss, and `outputs.logits` is None,
since no step holds the whole logits (as Liger Kernel's and Cut Cross-Entropy's forwards
return them). `optremat.plan` prices it by tracing the model under `running`, and
`optremat.apply` runs the planned training steps through it.

Only forwards read to have that form run so, and only while the model's forward, head and
loss function are its class's own; a call that computes no loss (no `labels`) or keeps
only some positions' logits (`logits_to_keep`) runs the model's own forward. A forward
has that form when its code is one of `TEMPLATES`' (transformers 5), read as Python's
parser reads it, but for the names of its base model and of the variable holding that
model's output, that output's annotated type, the class it returns, and which of the
base model's outputs it passes on (`_shape`): in transformers 5.24 that is 82 causal LMs, 56 of Llama's or GPT-2's form
(mixtures of experts without a load-balancing loss among them), 21 of Mixtral's and 5 of
Gemma 2's.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Callable, Iterator, get_args

import torch
import torch.nn as nn

from optremat.tracing.deferred_head import WIDENING, chunked_by, deferrable, deferring, returned
from optremat.tracing.extract import fake_output, tracing
from optremat.tracing.inputs import call_of, own_loss
from optremat.tracing.lm_loss import AUTO, CausalLMLoss, check_chunks
from optremat.tracing.repeat import MODULE_HOOKS


@dataclass(frozen=True)
class Form:
    """What a causal LM's forward does around its head and loss: the config attribute
    holding the softcap of its logits (Gemma 2's), whether it adds its router's
    load-balancing loss when it collects the router logits (Mixtral's), and (for one
    class, `_form`) the base model's attribute and the outputs of the base model its
    result passes on."""

    softcap: str | None = None
    router_loss: bool = False
    base: str = ""
    passed: tuple[str, ...] = ()


TEMPLATES = {"LlamaForCausalLM": Form(), "GPT2LMHeadModel": Form(),
             "Gemma2ForCausalLM": Form(softcap="final_logit_softcapping"), "MixtralForCausalLM": Form(router_loss=True)}
"""transformers 5's causal LMs whose forward is `outputs = self.<base model>(<every
argument but labels and logits_to_keep>)`, `logits = self.lm_head(outputs.last_hidden_state
[:, -logits_to_keep:])`, softcapped as Gemma 2 does, then `self.loss_function(logits,
labels, vocab_size, **kwargs)` (plus the router's loss times its coefficient, Mixtral),
returned with some of the base model's outputs; every class whose forward's code is one
of these (`_shape`) runs the same way."""

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
    chunks, or None. FSDP2's own hooks do not: where a module of an FSDP2 group never
    runs its forward (a head run in chunks), the root's post-forward completes the group
    and its post-backward runs at the end of the backward (torch 2.13)."""
    head = model.get_output_embeddings()
    if any(not _fsdp2_own(head, hook) for name in MODULE_HOOKS for hook in getattr(head, name).values()):
        return f"{type(model).__name__}'s lm_head has hooks, which a head run in chunks would not call"
    if any(getattr(nn.modules.module, name) for name in _GLOBAL_HOOKS):
        return "a global module hook is registered, which a head run in chunks would not call on lm_head"
    return None


def _fsdp2_own(head: nn.Module, hook: Callable[..., Any]) -> bool:
    """Whether `hook` is one FSDP2 registers on `head` for a group of modules it shards
    together (another of which gathers the group's parameters as it runs, the final norm
    as accelerate groups them; a head sharded alone would never be gathered), in a torch
    whose root completes a group some module of which never ran its forward."""
    group = getattr(head, "_get_fsdp_state", None)
    if group is None or len(getattr(group(), "_modules", ())) < 2:
        return False
    function = inspect.unwrap(hook)
    defined_in = getattr(function, "__module__", None) or ""
    return (defined_in.startswith("torch.distributed.fsdp")
            and getattr(function, "__qualname__", "") in ("FSDPState._pre_forward", "FSDPState._post_forward")
            and hasattr(getattr(sys.modules[defined_in], "FSDPState", None), "_force_complete_incomplete_states"))


def _sharded_as(module: nn.Module) -> type:
    """The class of `module`, or the class FSDP2 made it a subclass of when it sharded it
    (`FSDP<class>`, which adds FSDP2's methods and no forward of its own)."""
    cls = type(module)
    first = cls.__bases__[0]
    sharded = (len(cls.__bases__) == 2 and first.__name__ == "FSDPModule"
               and first.__module__.startswith("torch.distributed.fsdp"))
    return cls.__bases__[1] if sharded else cls


def own_head(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
             head_chunks: int | str | None) -> tuple[str, int] | None:
    """The head of a causal LM whose own loss a call on `example_inputs` (as
    `optremat.plan` reads them) computes, when `head_chunks` ("auto", or a count of
    token chunks) asks to run it in chunks and the call can: the name `named_parameters`
    gives its weight, and the positions its loss covers. The loss is a transformers
    causal LM's (a form in `TEMPLATES`), or else the cross-entropy the model's forward
    takes over an `nn.Linear` head's logits (`deferred_head`). None where the step runs
    as the model runs it: `head_chunks` None, a `loss_fn` given, or, for "auto", a model
    or call whose own loss cannot run with the head in chunks (a ValueError for a count)."""
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
    elif _form(_defining(type(model))) is None:
        found = _deferred_head(model, example_inputs)
        if found is not None:
            return found
        reason = (f"{reason}; nor does its forward return, as its loss, F.cross_entropy over the logits of an "
                  f"nn.Linear head at least {WIDENING} times wider than its input, flattened to one row per "
                  "position in float32 and read by nothing else before (deferred_head)")
    if reason is not None:
        if head_chunks == AUTO:
            return None
        raise ValueError(f"head_chunks={head_chunks!r} cannot run: {reason}; leave head_chunks out to run the "
                         "model's own forward")
    weight = model.get_output_embeddings().weight
    return _weight_name(model, weight), call[2].numel()


def _weight_name(model: nn.Module, weight: torch.Tensor) -> str:
    return next(name for name, p in model.named_parameters() if p is weight)


def _deferred_head(model: nn.Module, example_inputs: Any) -> tuple[str, int] | None:
    """The head whose logits the model's own loss is a chunked cross-entropy of, its
    forward run on fake tensors with every `deferrable` head deferred: its weight's
    name and the positions its loss covers; None for a model with no such loss, or
    whose forward cannot run so (its trace says why)."""
    heads = [m for m in model.modules() if deferrable(m)]
    if not heads:
        return None
    try:
        with deferring(heads, 1) as losses:
            out = fake_output(model, example_inputs)
        loss = own_loss(returned(out, losses))
    except Exception:  # noqa: BLE001 - a forward a trace cannot take is reported by the trace
        return None
    found = chunked_by(loss)
    return None if found is None else (_weight_name(model, found[0].weight), found[1])


def _global_backward_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_backward_hooks or module._global_backward_pre_hooks)


def chunked_forward(model: nn.Module, head: str, chunks: int) -> "HeadInChunks | DeferredHead":
    """What runs `model`'s forward with its own LM head and loss in `chunks` token chunks,
    the head's weight named `head`: `HeadInChunks` for a forward of a form in
    `TEMPLATES`, `DeferredHead` otherwise."""
    if _runs_a_template(model):
        return HeadInChunks(chunks)
    return DeferredHead(head, chunks)


def _runs_a_template(model: nn.Module) -> bool:
    """Whether `model` runs its class's forward and that has a form of `TEMPLATES`."""
    return _runs_its_class_forward(model) and _form(_defining(type(model))) is not None


def own_chunks(model: nn.Module, chunks: int | None, head: str | None = None) -> int | None:
    """`chunks`, the token chunks a plan runs a causal LM's head in (`Plan.chunking`),
    where they are for `model`'s own head and loss: where `model` runs its class's
    forward and that has a form of `TEMPLATES`, or, the head's weight named `head`,
    where that weight is a `deferrable` head's (the other way to chunk a head, a
    `CausalLMLoss`, reads hidden states, which neither kind of forward returns). None
    otherwise; a ValueError saying why where they are and the model's own loss cannot
    run with its head in chunks now (hooks on its head, another loss function)."""
    if chunks is None:
        return None
    if not _runs_a_template(model):
        return chunks if head is not None and DeferredHead(head, chunks).heads(model) else None
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    return chunks


@dataclass(frozen=True)
class DeferredHead:
    """A model's forward with the `deferrable` heads holding the weight named `head`
    deferred (`deferred_head`): a cross-entropy the forward takes over their logits runs
    in `chunks` token chunks, and logits only it read come back as None. Called as
    `DeferredHead(head, k)(model, forward, *args, **kwargs)`, `forward` being the model's own."""

    head: str
    chunks: int

    def heads(self, model: nn.Module) -> list[nn.Module]:
        """The modules deferred."""
        weight = dict(model.named_parameters()).get(self.head)
        return [m for m in model.modules() if deferrable(m) and m.weight is weight]

    def __call__(self, model: nn.Module, forward: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        heads = self.heads(model)
        if not heads:
            warnings.warn(f"optremat: no plain nn.Linear holds {self.head} now (FSDP2 sharded the head as a unit of "
                          "its own, or it was replaced): the head and its loss run whole, as unplanned (the step's "
                          "memory is not the plan's)", stacklevel=3)
        elif any(m._backward_hooks or m._backward_pre_hooks for m in heads) or _global_backward_hooks():
            warnings.warn(f"optremat: a backward hook is on the LM head holding {self.head}, which sees its logits' "
                          "gradient: the head and its loss run whole, as unplanned (the step's memory is not the "
                          "plan's)", stacklevel=3)
            heads = []
        with deferring(heads, self.chunks) as losses:
            out = forward(*args, **kwargs)
        return returned(out, losses)


@dataclass(frozen=True)
class HeadInChunks:
    """A causal LM's forward (of a form in `TEMPLATES`) with its head and loss run by
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
        form = _form(_defining(type(model)))
        passed = extra.pop("return_dict", None)  # as transformers' can_return_tuple reads it
        return_dict = getattr(model.config, "return_dict", True) if passed is None else passed
        if form.router_loss and arguments.get("output_router_logits") is None:
            arguments["output_router_logits"] = model.config.output_router_logits
        loss_fn = CausalLMLoss(model.get_output_embeddings(), labels, ignore_index=extra.get("ignore_index", -100),
                               shift=extra.get("shift_labels") is None,
                               num_items_in_batch=extra.get("num_items_in_batch"),
                               softcap=None if form.softcap is None else getattr(model.config, form.softcap, None),
                               chunks=self.chunks)
        outputs = (model.base_model if self.base is None else self.base(loss_fn))(**arguments, **extra)
        loss = loss_fn(outputs.last_hidden_state)
        kept = {name: getattr(outputs, name) for name in form.passed}
        if form.router_loss:
            kept["aux_loss"] = _router_loss(model, outputs, arguments)
            if kept["aux_loss"] is not None:
                loss = loss + model.router_aux_loss_coef * kept["aux_loss"].to(loss.device)
        output = _output_class(type(model))(loss=loss, logits=None, **kept)
        if return_dict:
            return output
        # as ModelOutput.to_tuple, which leaves out what is None, but with the logits' place kept
        return tuple(getattr(output, f.name) for f in fields(output)
                     if f.name == "logits" or getattr(output, f.name) is not None)


def _router_loss(model: nn.Module, outputs: Any, arguments: dict[str, Any]) -> torch.Tensor | None:
    """The router's load-balancing loss as a forward of Mixtral's form computes it, by
    the function its module defines; None where the call collects no router logits."""
    if not arguments["output_router_logits"]:
        return None
    balance = inspect.unwrap(_defining(type(model)).forward).__globals__["load_balancing_loss_func"]
    return balance(outputs.router_logits, model.num_experts, model.num_experts_per_tok, arguments.get("attention_mask"))


@contextmanager
def running(model: nn.Module, chunks: int | None, head: str | None = None) -> Iterator[None]:
    """While it lasts (a trace), `model(...)` runs its head and loss in `chunks` token
    chunks (`chunked_forward`, the head's weight named `head`); None leaves the model as
    it is."""
    if chunks is None:
        yield
        return
    before = model.__dict__.get("forward")
    model.forward = functools.partial(chunked_forward(model, head, chunks), model, model.forward)
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
    transformers = sys.modules.get("transformers")
    if transformers is not None and int(transformers.__version__.split(".")[0]) < 5:
        return f"{name}'s forward in transformers {transformers.__version__} is not the one read; transformers 5 has it"
    form = _form(defining)
    if form is None:
        return (f"{name} runs {defining.__qualname__}.forward, and the causal LMs whose own loss runs with the head "
                f"in chunks are transformers' whose forward is {', '.join(TEMPLATES)}'s but for the types it names")
    if getattr(model, form.base, None) is not model.base_model:
        return f"{name}'s forward runs its {form.base}, which is not its base_model"
    signature = _signature(type(model))
    result = _output_class(type(model))
    if (not all(p in signature.parameters for p in _SPLIT) or result is None
            or not {"loss", "logits"} <= {f.name for f in fields(result)}):
        return f"{name}'s forward does not take labels and logits_to_keep and return loss and logits"
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        return f"{name}'s loss_function is not transformers' ForCausalLMLoss"
    if _sharded_as(model.get_output_embeddings()) is not nn.Linear:
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


@functools.cache
def _form(defining: type) -> Form | None:
    """The form of the forward `defining` defines, its base model's attribute and the
    outputs it passes on filled in: that of the first of `TEMPLATES` whose code it has
    (`_shape`), where its base model is handed every argument but labels and
    logits_to_keep; None for a class outside transformers' models or of no such form."""
    read = _shape(defining) if defining.__module__.startswith("transformers.models.") else None
    if read is None:
        return None
    shape, base, handed, passed = read
    taken = [p.name for p in _signature(defining).parameters.values()
             if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name not in _SPLIT][1:]
    if sorted(handed) != sorted(taken):
        return None
    transformers = sys.modules["transformers"]
    for name, form in TEMPLATES.items():
        template = getattr(transformers, name, None)
        known = None if template is None else _shape(_defining(template))
        if known is not None and known[0] == shape:
            return replace(form, base=base, passed=passed)
    return None


@functools.cache
def _shape(cls: type) -> tuple[str, str, tuple[str, ...], tuple[str, ...]] | None:
    """`cls`'s forward as Python's parser reads it, without its docstring, and with what
    may differ between forwards of one form made alike: the base model's attribute, the
    variable holding its output and that output's annotated type, the class of the
    result, and the base model's outputs the result passes on unchanged. Then the base
    model's attribute, the names of the arguments handed to it, and the outputs passed
    on. None where the source cannot be read, or no `self.<attribute>(...)` is called
    into a variable."""
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    body = list(getattr(function, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    body = [ast.Assign([s.target], s.value) if isinstance(s, ast.AnnAssign) and s.value is not None else s
            for s in body]
    first = next((s for s in body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                  and isinstance(s.value.func, ast.Attribute) and isinstance(s.value.func.value, ast.Name)
                  and s.value.func.value.id == "self"), None)
    if first is None or len(first.targets) != 1 or not isinstance(first.targets[0], ast.Name):
        return None
    held, base = first.targets[0].id, first.value.func.attr
    handed = tuple([a.id for a in first.value.args if isinstance(a, ast.Name)]
                   + [k.arg for k in first.value.keywords if k.arg is not None])
    passed: list[str] = []
    for statement in body:
        if isinstance(statement, ast.Return) and isinstance(statement.value, ast.Call):
            call = statement.value
            passed = [k.arg for k in call.keywords if isinstance(k.value, ast.Attribute)
                      and isinstance(k.value.value, ast.Name) and k.value.value.id == held and k.value.attr == k.arg]
            call.keywords = [k for k in call.keywords if k.arg not in passed]
            call.func = ast.Name("RESULT")
    first.value.func.attr = "BASE"
    for node in ast.walk(ast.Module(body, [])):
        if isinstance(node, ast.Name) and node.id == held:
            node.id = "OUTPUTS"
    return ast.dump(ast.Module(body, [])), base, handed, tuple(passed)


def _runs_its_class_forward(model: nn.Module) -> bool:
    """Whether a call of `model` runs its class's forward, not one set on the model."""
    forward = model.__dict__.get("forward")
    forward = getattr(forward, "replaced", forward)  # an installed plan's forward stands for the one it replaced
    return forward is None or getattr(forward, "__func__", None) is type(model).forward


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """The signature of the forward `cls` runs, through its decorators."""
    return inspect.signature(cls.forward)


def _output_class(cls: type) -> type | None:
    """The output dataclass the forward `cls` runs returns, by its annotation: the class
    itself, or the one dataclass of a union (Glm4's `tuple | CausalLMOutputWithPast`);
    None where there is none."""
    result = _signature(cls).return_annotation
    members = [a for a in get_args(result) if is_dataclass(a)] if get_args(result) else [result]
    return members[0] if len(members) == 1 and is_dataclass(members[0]) else None
