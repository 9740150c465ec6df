"""A model nobody tuned for: a Llama from transformers' config (random weights, sdpa
attention, tied embeddings, a dataclass output), its loss computed outside the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import optremat
from optremat.runtime.measure import measure_peak

transformers = pytest.importorskip("transformers")


def llama(layers: int, seq: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small Llama from its config, whose unplanned step is predicted within 0.01% on a
    CPU, so that the peak test measures what the plan adds."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=512, attn_implementation="sdpa",
                                      tie_word_embeddings=True, use_cache=False)
    ids = torch.randint(0, 8192, (4, seq))
    return transformers.LlamaForCausalLM(config).train(), ids, torch.randint(0, 8192, (4 * seq,))


def grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """One step's gradients, the output held through the backward as a training loop holds it."""
    out = model(ids)
    loss = F.cross_entropy(out.logits.float().view(-1, 8192), labels)
    return list(torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))


@pytest.mark.parametrize("layers,seq", [(2, 64), pytest.param(4, 256, marks=pytest.mark.slow)])
def test_llama_without_loss_fn_runs_at_its_predicted_peak_with_the_same_gradients(layers: int, seq: int,
                                                                                  device: str) -> None:
    model, ids, labels = llama(layers, seq)
    model, ids, labels = model.to(device), ids.to(device), labels.to(device)
    want = grads(model, ids, labels)
    plan = optremat.plan(model, (ids,), 0.9, time_limit=5)
    assert plan.regions and "not given" in plan.summary()
    optremat.apply(model, plan)
    for got, expected in zip(grads(model, ids, labels), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    params = list(model.parameters())
    measured = measure_peak(lambda: grads(model, ids, labels), resident=[params, list(model.buffers()), ids],
                            device=device).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, (measured, plan.summary())
    assert measured <= 1.02 * plan.budget_bytes
    twin = copy.deepcopy(model)
    assert optremat.remove(twin) is twin and not hasattr(twin, "_optremat_runtime")
