"""transformers causal LMs called with `labels`: the plan runs their own head and loss in
token chunks, with the loss and gradients of the unplanned step and `outputs.logits` None."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import optremat
from optremat.planning import chunking
from optremat.runtime.measure import measure_step

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

V, T, B = 2048, 64, 2
BUDGET = 0.6
"""Of the unplanned step: below the least peak of any plan with the whole head, for every family."""

LAYERS = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=T, use_cache=False)
FAMILIES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=64, n_layer=2, n_head=4, use_cache=False, bos_token_id=0, eos_token_id=0)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LAYERS)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**LAYERS)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LAYERS)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**LAYERS, head_dim=16)),
    "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**LAYERS, head_dim=16)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**LAYERS, head_dim=16,
                                                                               final_logit_softcapping=0.2)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**LAYERS, head_dim=16,
                                                                                   final_logit_softcapping=0.2)),
    "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**LAYERS)),
    "glm4": lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(**LAYERS, head_dim=16, pad_token_id=0)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **LAYERS, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)),
}
"""Small models from their configs: GPT-2 and the Gemmas tie the head to the embedding,
GPT-2 has dropout, Gemma 2's and 3's softcapping (0.2) bends their logits (about 0.2 at
random initialisation) well away from the identity, and the Mixtral adds its router's
load-balancing loss. OLMo 2, GLM-4, Gemma 3 and Mixtral are named nowhere in optremat:
their forwards have the code of Llama's, Gemma 2's and Mixtral's (GLM-4's annotated as
returning `tuple | CausalLMOutputWithPast`, so its head ran whole before)."""


def built(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A family's model in training mode and a batch whose labels ignore a few positions."""
    torch.manual_seed(0)
    model = FAMILIES[family]().train()
    ids = torch.randint(0, V, (B, T))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, 30] = -100
    return model, {"input_ids": ids, "labels": labels}


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The loss and every parameter's gradient of one step, dropout drawn alike."""
    torch.manual_seed(1)
    loss = model(**batch).loss
    return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.fixture
def two_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole head and one chunk count priced, to keep a test short."""
    monkeypatch.setattr(chunking, "CHOICES", (None, 4))


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in ("qwen3", "gemma", "gemma3") else f
                                    for f in FAMILIES])
def test_the_plan_runs_the_models_own_head_and_loss_in_chunks(family: str, two_choices) -> None:
    model, batch = built(family)
    want = step(model, batch)
    found = optremat.plan(model, batch, BUDGET, time_limit=5)
    assert found.chunking.chunks == 4 and found.predicted_peak_bytes <= found.budget_bytes
    assert "in 4 token chunks, so the logits it returns are None" in found.summary()
    optremat.apply(model, found)
    try:
        assert model(**batch).logits is None
        assert_same(step(model, batch), want)
        measured = measure_step(model, batch).peak_bytes
    finally:
        optremat.remove(model)
    assert measured <= found.budget_bytes * 1.02 and abs(measured / found.predicted_peak_bytes - 1) < 0.05
    assert model(**batch).logits.shape == (B, T, V)


def test_a_mixtures_tuple_keeps_its_router_loss_and_the_logits_place(two_choices) -> None:
    """Called with return_dict=False, Mixtral returns (loss, aux_loss, logits, ...) less
    what is None: the chunked step's tuple has the same places, None for the logits."""
    model, batch = built("mixtral")
    want = model(**batch, return_dict=False)
    found = optremat.plan(model, batch, BUDGET, time_limit=5)
    optremat.apply(model, found)
    try:
        got = model(**batch, return_dict=False)
    finally:
        optremat.remove(model)
    assert found.chunking.chunks == 4 and len(got) == len(want) and got[2] is None
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert want[1] > 0 and (got[0] - want[0]).abs() < 1e-5


def test_no_plan_with_the_whole_head_fits_that_budget() -> None:
    model, batch = built("llama")
    with pytest.raises(optremat.InfeasibleBudget):
        optremat.plan(model, batch, BUDGET, head_chunks=None, time_limit=5)


def test_trainer_style_num_items_in_batch_divides_the_summed_loss(two_choices) -> None:
    """Under gradient accumulation transformers' Trainer passes the count of labelled
    tokens over all micro-batches, and the model sums its loss and divides by it."""
    model, batch = built("gpt2")
    batch["num_items_in_batch"] = torch.tensor(3 * B * T)
    want = step(model, batch)
    found = optremat.plan(model, batch, BUDGET, time_limit=5)
    optremat.apply(model, found)
    try:
        assert_same(step(model, batch), want)
    finally:
        optremat.remove(model)
    assert found.chunking.chunks == 4 and want[0] < step(model, {**batch, "num_items_in_batch": None})[0] / 2


@pytest.fixture(scope="module")
def chunked() -> tuple[nn.Module, dict[str, torch.Tensor], list[torch.Tensor], optremat.Plan]:
    """A Llama, its batch and unplanned step, and a plan running its head in 4 chunks."""
    model, batch = built("llama")
    return model, batch, step(model, batch), optremat.plan(model, batch, 1.0, head_chunks=4, time_limit=5)


def test_a_chunked_model_runs_its_own_forward_where_a_step_needs_the_logits(chunked) -> None:
    """Without labels, under no_grad or in eval mode (an evaluation loop computing
    metrics), the model returns its logits as it does unplanned; with return_dict=False
    a chunked step's tuple has None in the logits' place, so that it unpacks as unplanned."""
    model, batch, _, found = chunked
    optremat.apply(model, found)
    try:
        assert model(input_ids=batch["input_ids"]).logits.shape == (B, T, V)
        with torch.no_grad():
            assert model(**batch).logits.shape == (B, T, V)
        model.eval()
        with pytest.warns(UserWarning, match="made in train mode"):
            assert model(**batch).logits.shape == (B, T, V)
        model.train()
        loss, logits = model(**batch, return_dict=False)
        assert logits is None and loss.dim() == 0
    finally:
        optremat.remove(model)


def test_a_second_backward_through_a_kept_graph_gets_the_unplanned_gradients(chunked) -> None:
    """A gradient taken with retain_graph=True (a norm of some parameters' gradients,
    say) and then the step's backward: the chunks' saved gradients are scaled into new
    tensors while the graph is kept, so the second backward reads them unscaled."""
    model, batch, _, found = chunked

    def twice() -> list[torch.Tensor]:
        torch.manual_seed(1)
        loss = model(**batch).loss
        first = torch.autograd.grad(0.5 * loss, [model.lm_head.weight], retain_graph=True)
        rest = torch.autograd.grad(0.5 * loss, list(model.parameters()))
        return [*first, *rest]

    want = twice()
    optremat.apply(model, found)
    try:
        assert_same(twice(), want)
    finally:
        optremat.remove(model)


def test_a_gradient_penalty_through_the_chunked_head_is_refused_not_computed_wrong(chunked) -> None:
    """The chunks compute their gradients in the forward, so they have none of their
    own: a backward with create_graph=True says so instead of dropping those terms."""
    model, batch, _, found = chunked
    optremat.apply(model, found)
    try:
        loss = model(**batch).loss
        with pytest.raises(RuntimeError, match="no second derivative.*head_chunks=None"):
            torch.autograd.grad(loss, [model.model.layers[1].mlp.down_proj.weight], create_graph=True)
    finally:
        optremat.remove(model)


def test_a_plan_file_chunks_the_model_which_pickles_copies_and_saves_with_its_plan(chunked, tmp_path) -> None:
    model, batch, want, found = chunked
    found.save(tmp_path / "plan.json")
    optremat.apply(model, optremat.Plan.load(tmp_path / "plan.json"))
    try:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        for twin in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
            assert twin(**batch).logits is None
            assert_same(step(twin, batch), want)
        model.save_pretrained(tmp_path)
    finally:
        optremat.remove(model)
    loaded = type(model).from_pretrained(tmp_path).train()
    assert_same(step(loaded, batch), want)


def test_replanning_keeps_the_head_in_the_applied_chunks(chunked) -> None:
    model, batch, _, found = chunked
    longer = {key: torch.cat([t, t], dim=1) for key, t in batch.items()}
    want = step(model, longer)
    replan = optremat.Replanning(time_limit=5)
    optremat.apply(model, found, replan=replan)
    try:
        assert model(**longer).logits is None
        assert_same(step(model, longer), want)
    finally:
        optremat.remove(model)
    assert [p.chunking.chunks for p in replan.plans.values()] == [4] and found not in replan.plans.values()


def test_a_chunked_plan_is_priced_at_another_shape_with_its_head_in_chunks(chunked) -> None:
    model, batch, _, found = chunked
    longer = {key: torch.cat([t, t], dim=1) for key, t in batch.items()}
    again = optremat.reprice(found, model, longer)
    whole = optremat.price_regions(model, longer, found.regions)
    assert again.chunking == found.chunking and "the logits it returns are None" in again.summary()
    assert again.predicted_peak_bytes < whole.predicted_peak_bytes - B * 2 * T * V * 4


def test_a_chunked_plan_is_refused_by_a_model_whose_head_got_hooks_since(chunked) -> None:
    model, _, _, found = chunked
    handle = model.lm_head.register_forward_hook(lambda module, args, out: None)
    try:
        with pytest.raises(optremat.PlanMismatch, match="lm_head has hooks"):
            optremat.apply(model, found)
    finally:
        handle.remove()
    assert "forward" not in model.__dict__


def test_a_hook_put_on_the_head_after_the_plan_runs_with_the_head_whole(chunked) -> None:
    """A hook a chunked head would not call, added once the plan is on: the model's own
    head and loss run, with a warning, and the step is the unplanned one with the hook."""
    model, batch, _, found = chunked
    optremat.apply(model, found)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    try:
        with pytest.warns(UserWarning, match="lm_head has hooks"):
            got = step(model, batch)
        optremat.remove(model)
        assert_same(got, step(model, batch))
    finally:
        handle.remove()
        optremat.remove(model)


def test_head_chunks_that_cannot_run_are_refused_before_tracing() -> None:
    model, batch = built("llama")

    class Transposed(transformers.LlamaForCausalLM):
        """Its loss over the logits laid out [batch, vocabulary, tokens], not one row per position."""

        def forward(self, input_ids, labels, **kwargs):
            logits = super().forward(input_ids, **kwargs).logits.float()
            return {"loss": nn.functional.cross_entropy(logits.transpose(1, 2)[..., :-1], labels[:, 1:])}

    transposed = Transposed(model.config)
    cases = [(dict(head_chunks=4, loss_fn=lambda out: out.loss), "loss_fn replaces it"),
             (dict(head_chunks=0), "chunks must be"),
             (dict(head_chunks=4, example_inputs={"input_ids": batch["input_ids"]}), "compute its loss"),
             (dict(head_chunks=4, model=transposed), "runs .*Transposed.forward, and the causal LMs")]
    for options, message in cases:
        options = {"model": model, "example_inputs": batch, "budget": 1.0, **options}
        with pytest.raises(ValueError, match=message):
            optremat.plan(options.pop("model"), options.pop("example_inputs"), options.pop("budget"), **options)
    assert optremat.plan(transposed, batch, 1.0, time_limit=5).chunking is None


def test_a_subclass_with_a_forward_of_its_own_runs_the_head_deferred_in_chunks() -> None:
    """A causal LM whose forward is not one read (`causal_lm.TEMPLATES`), here a subclass
    calling its base class's, still runs its own loss in chunks: its head's logits are
    deferred until the loss function's cross-entropy reads them (`deferred_head`)."""
    model, batch = built("llama")

    class Custom(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    custom = Custom(model.config)
    custom.load_state_dict(model.state_dict())
    want = step(custom, batch)
    plan = optremat.plan(custom, batch, 1.0, head_chunks=4, time_limit=5)
    assert plan.chunking.chunks == 4
    optremat.apply(custom, plan)
    assert_same(step(custom, batch), want)
    assert custom(**batch).logits is None
    measured = measure_step(custom, batch).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes
