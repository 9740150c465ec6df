"""A model of many alike blocks traced through four of them: the step it builds is the
whole trace's, node for node, and blocks that differ are traced whole."""

from __future__ import annotations

import copy
import enum
import types
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn

import optremat
from optremat.models import GPT
from optremat.tracing import repeat
from optremat.tracing.causal_lm import running
from optremat.tracing.extract import DefaultLoss, Traced, trace
from optremat.tracing.lm_loss import CausalLMLoss

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

V, T, B = 96, 16, 2
LAYERS = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=T, use_cache=False)


def labelled(model: nn.Module) -> tuple[nn.Module, Any, Callable | None]:
    ids = torch.randint(0, V, (B, T))
    return model.train(), {"input_ids": ids, "labels": ids}, DefaultLoss()


def stack(blocks: int) -> tuple[nn.Module, Any, Callable | None]:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(24, 24), nn.GELU()) for _ in range(blocks)])
    return model, torch.randn(8, 24), None


MODELS = {
    "llama": lambda: labelled(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LAYERS))),
    "llama-meta-bf16": lambda: _meta_llama(),
    "gpt-dropout": lambda: (GPT(V, T, 32, 6, 4, dropout=0.1), torch.randint(0, V, (B, T)), None),
    "mixtral": lambda: labelled(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **LAYERS, num_local_experts=4, num_experts_per_tok=2))),
    "gpt-causal-lm-loss": lambda: _gpt_with_loss(),
    "gpt2": lambda: labelled(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=7, n_head=4, n_positions=T, use_cache=False))),
    "sequential": lambda: stack(8),
}
"""Models of 6 to 8 alike blocks: transformers' own loss from labels (a Llama, on the meta
device in bfloat16 as real-size models are planned, a Mixtral's experts, and GPT-2 with
its dropouts and tied head), optremat's
GPT with dropout and under a `CausalLMLoss` over its tied head, and a plain Sequential
whose blocks are the model's only modules."""


def _meta_llama() -> tuple[nn.Module, Any, Callable | None]:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LAYERS)).to(torch.bfloat16)
    ids = torch.zeros(B, T, dtype=torch.long, device="meta")
    return model.train(), {"input_ids": ids, "labels": ids}, DefaultLoss()


def _gpt_with_loss() -> tuple[nn.Module, Any, Callable | None]:
    model = GPT(V, T, 32, 6, 4)
    model.forward = model.hidden_states
    ids = torch.randint(0, V, (B, T))
    return model, ids, CausalLMLoss(model.head, ids, chunks=2)


def whole(model: nn.Module, inputs: Any, loss_fn: Callable | None, monkeypatch: pytest.MonkeyPatch) -> Traced:
    with monkeypatch.context() as patch:
        patch.setattr(repeat, "MIN_BLOCKS", 10 ** 9)
        return trace(model, inputs, loss_fn)


def assert_same_step(copied: Traced, traced: Traced) -> None:
    """Every column of the two steps' graphs and traces equal, the nodes' names aside."""
    a, b = copied.graph, traced.graph
    for column in ("ops", "kind", "module", "tensor"):
        assert getattr(a, column) == getattr(b, column), column
    for column in ("cost", "size", "backward", "alias_of", "output", "fusible", "workspace", "lives_to", "edges"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column), err_msg=column)
    np.testing.assert_array_equal(copied.grad_of, traced.grad_of)
    for field in ("gradients", "gradient_nodes", "calls", "random", "mutated_buffers", "cached_calls"):
        assert getattr(copied, field) == getattr(traced, field), field


@pytest.mark.parametrize("name", MODELS)
def test_a_model_of_alike_blocks_traced_through_four_is_its_whole_trace(name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    assert repeat.repeated_blocks(model) is not None
    copied = trace(model, inputs, loss_fn)
    traced_ops = sum(node.op == "call_function" for node in copied.module.graph.nodes)
    assert traced_ops < int(np.sum(np.array(copied.graph.kind) == "op"))
    assert_same_step(copied, whole(model, inputs, loss_fn, monkeypatch))


def test_a_causal_lm_run_with_its_head_in_chunks_is_copied_with_its_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["llama"]()
    with running(model, 4):
        copied = trace(model, inputs, loss_fn)
        assert_same_step(copied, whole(model, inputs, loss_fn, monkeypatch))
    assert "forward" not in model.__dict__
    assert len(model.model.layers) == LAYERS["num_hidden_layers"]


class Dense(nn.Module):
    """Each block reads the sum of every earlier block's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [x]
        for block in self.blocks:
            outputs.append(torch.tanh(block(sum(outputs))))
        return outputs[-1]


class EarlyExit(Dense):
    """Runs the first five blocks only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:5]:
            x = torch.tanh(block(x))
        return x


def traced_whole(traced: Traced) -> bool:
    return sum(node.op == "call_function" for node in traced.module.graph.nodes) == \
        int(np.sum(np.array(traced.graph.kind) == "op"))


def test_blocks_run_by_loops_not_read_or_alternating_are_traced_whole() -> None:
    """A loop not read to run every block once alike (an early exit, a transformers stack
    told to run fewer layers than it holds or to output hidden states), and Gemma 2's
    layers, which alternate sliding-window and global attention: traced whole."""
    torch.manual_seed(0)
    assert repeat.repeated_blocks(EarlyExit()) is None
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**LAYERS, head_dim=8))
    assert repeat.repeated_blocks(gemma) is None
    fewer = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LAYERS))
    fewer.config.num_hidden_layers -= 2
    assert repeat.repeated_blocks(fewer) is None
    model, batch, loss_fn = MODELS["llama"]()
    assert traced_whole(trace(model, {**batch, "output_hidden_states": True}, loss_fn))


def test_blocks_whose_trace_does_not_repeat_are_traced_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were a loop that feeds each block every earlier output read as plain, the trace
    would show the second and third blocks reading unlike inputs: traced whole."""
    monkeypatch.setattr(repeat, "LOOPS", repeat.LOOPS | {f"{Dense.__module__}.{Dense.__qualname__}"})
    model = Dense()
    assert repeat.repeated_blocks(model) == ("blocks", 7)
    assert traced_whole(trace(model, torch.randn(4, 16)))


def test_tracing_leaves_the_model_as_it_was() -> None:
    """transformers installs its output-capturing hooks on the modules of the first model
    object it runs (a Mixtral collecting its router logits for its auxiliary loss); a
    trace through a copy of the model leaves none behind, so the model's own first run
    installs them once and its loss is the loss of a model never traced."""
    torch.manual_seed(0)
    model, batch, loss_fn = labelled(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **LAYERS, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)))
    untraced = copy.deepcopy(model)
    trace(model, batch, loss_fn)
    assert "forward" not in model.__dict__ and len(model.model.layers) == LAYERS["num_hidden_layers"]
    got, want = model(**batch), untraced(**batch)
    assert len(got.router_logits) == len(want.router_logits) == LAYERS["num_hidden_layers"]
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


def test_blocks_differing_in_shape_or_sharing_a_weight_are_not_alike() -> None:
    widths = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)] + [nn.Linear(8, 4)])
    shared = nn.Linear(8, 8)
    assert repeat.repeated_blocks(nn.Sequential(widths)) is None
    assert not repeat.alike([shared] + [nn.Linear(8, 8) for _ in range(5)] + [shared])


def test_a_planned_model_of_copied_blocks_trains_as_unplanned() -> None:
    torch.manual_seed(0)
    model, batch, _ = MODELS["llama"]()
    unplanned = _gradients(model, batch)
    plan = optremat.plan(model, batch, 0.76, time_limit=2, deterministic=True, head_chunks=None)
    assert any(r.path.startswith(("model.layers.3", "model.layers.4")) for r in plan.regions)  # copied blocks
    planned = _gradients(optremat.apply(model, plan), batch)
    for a, b in zip(planned, unplanned):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _gradients(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    loss = model(**batch).loss
    return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]


class Residual(nn.Module):
    """A residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(24, 48), nn.Linear(48, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Counted(Residual):
    """The fifth of a stack (`index`, its place) counts its calls (a warm-up counter):
    a rerun counts twice."""

    calls = 0

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 4:
            self.calls += 1
            return x + self.down(torch.relu(self.up(x))) * min(self.calls, 2)
        return super().forward(x)


class Kind(enum.Enum):
    PLAIN = 1
    WIDE = 2


def _noisy(self: Residual, x: torch.Tensor) -> torch.Tensor:
    noise = torch.randn(x.shape[0], 48, generator=self.generator)
    return x + self.down(torch.relu(self.up(x)) * (1 + noise))


def _one_differs(how: str) -> nn.Sequential:
    """Eight residual blocks of which the fifth differs in a way no plain attribute shows."""
    torch.manual_seed(0)
    blocks = [Counted(i) if how == "index" else Residual() for i in range(8)]
    if how == "forward":
        blocks[4].forward = types.MethodType(_noisy, blocks[4])
        blocks[4].generator = torch.Generator().manual_seed(3)
    elif how == "enum":
        for i, block in enumerate(blocks):
            block.kind = Kind.WIDE if i == 4 else Kind.PLAIN
    elif how == "hook":
        outputs: list[torch.Tensor] = []
        for block in blocks:
            block.register_forward_hook(lambda module, args, out: outputs.append(out))
    return nn.Sequential(*blocks)


@pytest.mark.parametrize("how", ["forward", "index", "enum", "hook"])
def test_blocks_that_differ_where_no_plain_attribute_shows_are_traced_whole(how: str) -> None:
    """A forward set on one block (drawing from its own generator), a user's block that
    branches on its index, an enum attribute, a hook a user put on every block (keeping
    each block's output, which a loss may read): a copy of the third block would not run
    as they do."""
    assert repeat.repeated_blocks(_one_differs("plain")) == ("", 8)
    assert repeat.repeated_blocks(_one_differs(how)) is None


def test_a_block_drawing_from_its_own_generator_is_never_rerun() -> None:
    model, x = _one_differs("forward"), torch.randn(64, 24)
    loss_fn = lambda out: out.square().mean()  # noqa: E731

    def step() -> list[torch.Tensor]:
        model[4].generator.manual_seed(3)
        return torch.autograd.grad(loss_fn(model(x)), list(model.parameters()))

    want = step()
    with pytest.raises(optremat.InfeasibleBudget, match="no plan checkpoints 4") as refused:
        optremat.plan(model, x, 0.45, loss_fn=loss_fn, time_limit=2, deterministic=True)
    plan = optremat.plan(model, x, refused.value.smallest, loss_fn=loss_fn, time_limit=2, deterministic=True)
    assert plan.regions
    optremat.apply(model, plan)
    for got, expected in zip(step(), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_model_with_some_blocks_checkpointed_is_still_traced_through_four() -> None:
    """Replanning traces a model whose plan is installed: the plan's forwards step aside
    in a trace, so they leave the blocks alike."""
    torch.manual_seed(0)
    model, batch, _ = MODELS["llama"]()
    plan = optremat.plan(model, batch, 0.76, time_limit=2, deterministic=True, head_chunks=None)
    optremat.apply(model, plan)
    assert any("forward" in block.__dict__ for block in model.model.layers)
    assert repeat.repeated_blocks(model) == ("model.layers", LAYERS["num_hidden_layers"])


def test_gemma_and_lora_on_every_layer_are_alike() -> None:
    """transformers' GELU holds a partial of its own in every layer, and peft's LoRA
    layers hold their module path among their keywords: neither changes what a layer
    computes."""
    torch.manual_seed(0)
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**LAYERS, head_dim=8))
    assert repeat.repeated_blocks(gemma) == ("model.layers", LAYERS["num_hidden_layers"])
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LAYERS)),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert repeat.repeated_blocks(lora) == ("base_model.model.model.layers", LAYERS["num_hidden_layers"])
