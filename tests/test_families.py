"""Model families nobody tuned for, from small transformers configs: an encoder-decoder
(T5), encoders (BERT and DistilBERT classifying sequences, ELECTRA), a vision transformer (ViT), convnets
(ResNet, ConvNeXt), mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, in float32 and
bfloat16) and a Phi decoder, each planned on a dict batch with labels (the model's own
loss), applied, and checked against the unplanned model: the same loss and gradients,
bitwise, and a measured peak within 5% of the prediction and at most 2% over the budget.
Other decoder LMs are tested in test_third_party.py and test_batches.py."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn

import optremat
from optremat.runtime.measure import measure_step
from optremat.tracing.extract import trace

transformers = pytest.importorskip("transformers")

Batch = dict[str, torch.Tensor]


def t5() -> tuple[nn.Module, Batch]:
    config = transformers.T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=256, num_layers=1,
                                   num_decoder_layers=1, num_heads=4, dropout_rate=0.1, use_cache=False,
                                   decoder_start_token_id=0, pad_token_id=0)
    ids = torch.randint(1, 1000, (4, 128))
    labels = torch.randint(1, 1000, (4, 64))
    return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                             "labels": labels}


def t5_as_a_trainer_leaves_it() -> tuple[nn.Module, Batch]:
    """T5 built with its default key/value cache on, then `config.use_cache = False` as
    transformers' Trainer sets it: the decoder stack keeps its own copy of the config, so
    it still builds a cache and hands it to every attention call."""
    config = transformers.T5Config(vocab_size=256, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
                                   relative_attention_num_buckets=8)
    model = transformers.T5ForConditionalGeneration(config)
    model.config.use_cache = False
    assert model.decoder.config.use_cache
    return model, {"input_ids": torch.randint(3, 256, (2, 32)), "labels": torch.randint(3, 256, (2, 16))}


def bert() -> tuple[nn.Module, Batch]:
    config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=256, num_labels=3)
    ids = torch.randint(0, 1000, (8, 128))
    return transformers.BertForSequenceClassification(config), {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
        "labels": torch.randint(0, 3, (8,))}


def electra() -> tuple[nn.Module, Batch]:
    """ELECTRA's discriminator, whose loss selects the unpadded tokens with a boolean mask:
    a size the data decides, priced at the most it can be."""
    config = transformers.ElectraConfig(vocab_size=256, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    ids = torch.randint(3, 256, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0
    return transformers.ElectraForPreTraining(config), {"input_ids": ids, "attention_mask": mask,
                                                        "labels": torch.randint(0, 2, (2, 32))}


def distilbert() -> tuple[nn.Module, Batch]:
    """DistilBERT classifying padded sequences, with dropout: its attention's reshaped
    projections are held by the forward's variables, in a checkpointed rerun too."""
    config = transformers.DistilBertConfig(vocab_size=200, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                           max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
                                           seq_classif_dropout=0.2, num_labels=3)
    ids = torch.randint(3, 200, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    return transformers.DistilBertForSequenceClassification(config), {"input_ids": ids, "attention_mask": mask,
                                                                      "labels": torch.tensor([0, 2])}


def phi() -> tuple[nn.Module, Batch]:
    """A Phi causal LM with dropout: its attention keeps the rotated query and key in
    variables (`torch.cat` results) through its output projection, in a checkpointed rerun too."""
    config = transformers.PhiConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.1,
                                    embd_pdrop=0.1, attention_dropout=0.1, use_cache=False)
    ids = torch.randint(3, 256, (2, 32))
    return transformers.PhiForCausalLM(config), {"input_ids": ids, "labels": ids}


def vit() -> tuple[nn.Module, Batch]:
    config = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=256, num_labels=10)
    return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(16, 3, 64, 64),
                                                            "labels": torch.randint(0, 10, (16,))}


def resnet() -> tuple[nn.Module, Batch]:
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2],
                                       layer_type="basic", num_labels=10)
    return transformers.ResNetForImageClassification(config), {"pixel_values": torch.randn(16, 3, 64, 64),
                                                               "labels": torch.randint(0, 10, (16,))}


def convnext() -> tuple[nn.Module, Batch]:
    config = transformers.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10)
    return transformers.ConvNextForImageClassification(config), {"pixel_values": torch.randn(16, 3, 64, 64),
                                                                 "labels": torch.randint(0, 10, (16,))}


def mixture_of_experts(kind: str, dtype: torch.dtype) -> Callable[[], tuple[nn.Module, Batch]]:
    """A causal LM whose MLPs are 4 experts, 2 routed per token, in `dtype`, with transformers'
    default experts implementation (grouped_mm): its routed rows are priced as
    tokens × top-k, however the router spreads them."""

    def build() -> tuple[nn.Module, Batch]:
        shape = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, use_cache=False)
        if kind == "mixtral":
            config = transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, **shape)
            model = transformers.MixtralForCausalLM(config)
        elif kind == "qwen2-moe":
            config = transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=64,
                                                 shared_expert_intermediate_size=128, num_experts=4, **shape)
            model = transformers.Qwen2MoeForCausalLM(config)
        else:
            config = transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                                 head_dim=16, **shape)
            model = transformers.Qwen3MoeForCausalLM(config)
        ids = torch.randint(0, 1000, (2, 256))
        return model.to(dtype), {"input_ids": ids, "labels": ids}

    return build


def own_loss_step(model: nn.Module, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
    """A step as a Trainer takes it: the model's own loss from `labels`, dropout seeded."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(5)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def plans_exactly_within_budget(build: Callable[[], tuple[nn.Module, Batch]], budget: float | int) -> optremat.Plan:
    """Plan the family at `budget` and apply it: loss and gradients equal the unplanned
    step's bitwise; the planned step's measured peak is within 5% of the prediction and at
    most 2% over the budget. A causal LM's head runs whole (`head_chunks=None`): its
    chunks sum the loss in another order (`tests/test_hf_chunked.py` has them)."""
    torch.manual_seed(0)
    model, batch = build()
    model.train()
    state = copy.deepcopy(model.state_dict())
    want = own_loss_step(model, batch)
    model.load_state_dict(state)
    plan = optremat.plan(model, batch, budget, time_limit=0.3, deterministic=True, head_chunks=None)
    assert plan.regions and "the model's own" in plan.summary()
    optremat.apply(model, plan)
    model.load_state_dict(state)
    got = own_loss_step(model, batch)
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)
    measured = measure_step(model, batch).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, (measured, plan.summary())
    assert measured <= 1.02 * plan.budget_bytes, (measured, plan.summary())
    return plan


def test_an_encoder_decoder_t5_plans_exactly_within_its_budget() -> None:
    plans_exactly_within_budget(t5, 0.7)


def test_a_t5_whose_decoder_hands_its_attention_a_cache_never_checkpoints_those_calls() -> None:
    """Checkpointing a call that writes a cache made outside it fails in the backward
    (its rerun writes again and saves other tensors): such calls are left out of plans,
    even at the least peak the others reach."""
    torch.manual_seed(0)
    model, batch = t5_as_a_trainer_leaves_it()
    cached = trace(model.train(), batch).cached_calls
    assert ("decoder.block.1.layer.1.EncDecAttention", 0) in cached and ("decoder.block.1.layer.2", 0) not in cached
    with pytest.raises(optremat.InfeasibleBudget) as refused:
        optremat.plan(model, batch, 0.3, time_limit=0.3, deterministic=True, head_chunks=None)
    plan = plans_exactly_within_budget(t5_as_a_trainer_leaves_it, refused.value.smallest)
    assert not {(region.path, region.call) for region in plan.regions} & cached


def test_an_encoder_bert_classifying_sequences_plans_exactly_within_its_budget() -> None:
    plans_exactly_within_budget(bert, 0.7)


def test_an_electra_whose_loss_selects_tokens_by_a_mask_plans_exactly_within_its_budget() -> None:
    plans_exactly_within_budget(electra, 0.75)


def test_a_distilbert_plans_exactly_within_its_budget() -> None:
    plans_exactly_within_budget(distilbert, 0.8)


@pytest.mark.parametrize("build", [distilbert, phi], ids=["distilbert", "phi"])
def test_attention_with_dropout_plans_exactly_at_the_least_peak_a_refusal_names(
        build: Callable[[], tuple[nn.Module, Batch]]) -> None:
    torch.manual_seed(0)
    model, batch = build()
    with pytest.raises(optremat.InfeasibleBudget) as refused:
        optremat.plan(model.train(), batch, 0.5, time_limit=0.3, deterministic=True, head_chunks=None)
    plans_exactly_within_budget(build, refused.value.smallest)


def test_a_vision_transformer_plans_exactly_within_its_budget() -> None:
    plans_exactly_within_budget(vit, 0.7)


@pytest.mark.parametrize("build", [bert, vit], ids=["bert", "vit"])
def test_a_classifier_planned_before_its_first_call_checkpoints_its_layers(build: Callable) -> None:
    """BERT's and ViT's heads set `config.problem_type` on their first call, after the
    layers ran. Planned before it, as `PlanCallback` plans before the first step, every
    layer was kept out of the plan (reruns in the backward would have read the config the
    head changed). A rerun now finds the config as its call found it: the layers are
    planned, and every step, the first included, is the unplanned one bitwise."""
    torch.manual_seed(0)
    model, batch = build()
    model.train()
    reference = copy.deepcopy(model)
    assert model.config.problem_type is None
    plan = optremat.plan(model, batch, 0.7, time_limit=0.3, deterministic=True)
    assert any(".layer" in region.path for region in plan.regions), plan.summary()
    optremat.apply(model, plan)
    for _ in range(2):
        got, want = own_loss_step(model, batch), own_loss_step(reference, batch)
        assert got[0] == want[0] and got[1].keys() == want[1].keys()
        for name, grad in want[1].items():
            torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)


def test_a_resnet_plans_exactly_within_its_budget() -> None:
    """At 90%: this ResNet's smallest budget of module regions is 87% of its unplanned
    peak, which falls in its first stage, at the largest resolution."""
    plans_exactly_within_budget(resnet, 0.9)


def test_a_convnext_plans_exactly_within_its_budget() -> None:
    plans_exactly_within_budget(convnext, 0.8)


@pytest.mark.parametrize("kind,dtype", [
    pytest.param(kind, dtype, id=f"{kind}-{str(dtype).removeprefix('torch.')}",
                 marks=[pytest.mark.slow] if slow else [])
    for kind, dtype, slow in [("mixtral", torch.float32, False), ("qwen2-moe", torch.bfloat16, False),
                              ("mixtral", torch.bfloat16, True), ("qwen2-moe", torch.float32, True),
                              ("qwen3-moe", torch.float32, True), ("qwen3-moe", torch.bfloat16, True)]])
def test_a_mixture_of_experts_plans_exactly_within_its_budget(kind: str, dtype: torch.dtype) -> None:
    plans_exactly_within_budget(mixture_of_experts(kind, dtype), 0.7)
