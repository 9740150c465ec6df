"""optremat where users turn checkpointing on today: transformers' Trainer, and
accelerate's FSDP2 plugin."""

from __future__ import annotations

import os
import random
from typing import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

import optremat

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from optremat.distributed import run_local  # noqa: E402 - after the skips
from optremat.distributed.trial import rank_peak, whole_gradients  # noqa: E402
from optremat.integrations.accelerate import Prepare  # noqa: E402
from optremat.integrations.transformers import PlanCallback  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """Random token sequences as a causal LM trains on them: input_ids and labels."""

    def __init__(self, count: int, length: int) -> None:
        self.ids = torch.randint(0, 2000, (count, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class MaskedAtRandom(Tokens):
    """Each sequence's first labels ignored, how many drawn from Python's and numpy's
    generators, as data pipelines draw crops and masks."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[:random.randint(0, 8) + int(np.random.randint(0, 8))] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class ReadOnce(torch.utils.data.IterableDataset):
    """A stream whose every `iter` continues the one iterator."""

    def __init__(self) -> None:
        self.items = iter(list(Tokens(12, 128)))

    def __iter__(self):
        return self.items


def train(tmp_path, callbacks: list, checkpointing: bool = False,
          prepare: Callable[[torch.nn.Module], object] | None = None,
          dataset: torch.utils.data.Dataset | None = None) -> list[float]:
    """Losses of three Trainer steps of a GPT-2 from its config, seeded alike (the model
    handed to `prepare` first, if given), on `dataset` (random tokens unless given)."""
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=2000, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if prepare is not None:
        prepare(model)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                          seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset or Tokens(12, 128),
                                   callbacks=callbacks)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_the_trainer_callback_plans_on_the_first_batch_and_trains_the_same(tmp_path) -> None:
    want = train(tmp_path / "plain", [])
    callback = PlanCallback(0.7, cache=tmp_path / "plans", time_limit=1, deterministic=True)
    got = train(tmp_path / "planned", [callback])
    assert callback.plan is not None and (callback.plan.regions or callback.plan.chunking.chunks)
    assert "the model's own" in callback.plan.summary()
    assert got == pytest.approx(want, rel=1e-5)  # a head run in chunks sums the loss in another order
    again = PlanCallback(0.7, cache=tmp_path / "plans", time_limit=1, deterministic=True)
    train(tmp_path / "again", [again])
    assert again.plan.cached


def test_the_callback_leaves_the_data_as_training_would_read_it(tmp_path) -> None:
    """Reading the batch to plan on drew from Python's and numpy's generators, so the
    batches trained on were others; a stream read once would lose that batch, and is
    refused."""
    want = train(tmp_path / "plain", [], dataset=MaskedAtRandom(12, 128))
    got = train(tmp_path / "planned", [PlanCallback(0.9, time_limit=2, deterministic=True, head_chunks=None)],
                dataset=MaskedAtRandom(12, 128))
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="stream read once"):
        train(tmp_path / "stream", [PlanCallback(0.9, time_limit=2)], dataset=ReadOnce())


def test_the_trainer_trains_the_same_with_the_head_in_chunks(tmp_path) -> None:
    """GPT-2's own loss with its LM head and loss run in 4 token chunks under the Trainer:
    the same losses as unplanned, to float32's summation order."""
    want = train(tmp_path / "plain", [])
    callback = PlanCallback(0.9, time_limit=2, deterministic=True, head_chunks=4)
    got = train(tmp_path / "chunked", [callback])
    assert callback.plan.chunking.chunks == 4 and "4 token chunks" in callback.plan.summary()
    assert got == pytest.approx(want, rel=1e-5)


def test_the_trainer_trains_a_causal_lm_compiled_with_its_own_loss_the_same(tmp_path) -> None:
    """`compile_causal_lm`: the base model compiled under the plan, the head and the
    model's loss after it in the chunks the plan chose; the Trainer calls the model as
    always."""
    want = train(tmp_path / "plain", [])
    backend = optremat.compile_backend(0.6, inner="aot_eager", solver="dtr")
    got = train(tmp_path / "compiled", [], prepare=lambda model: optremat.compile_causal_lm(model, backend))
    assert backend.plans and backend.plans[0].chunking.chunks is not None
    assert got == pytest.approx(want, rel=1e-5)


def test_the_callback_refuses_a_model_with_transformers_own_checkpointing(tmp_path) -> None:
    with pytest.raises(ValueError, match="own activation checkpointing"):
        train(tmp_path, [PlanCallback(0.7, time_limit=5)], checkpointing=True)


def test_planning_refuses_a_model_with_transformers_own_checkpointing() -> None:
    """Planned with its own checkpointing on, a GPT-2's plan was priced as if it were off
    (its plan's peak measured 0.78 of the prediction), with the plan's regions run inside it."""
    config = transformers.GPT2Config(vocab_size=2000, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 2000, (2, 128))
    with pytest.raises(ValueError, match="own activation checkpointing on.*gradient_checkpointing_disable"):
        optremat.plan(model, {"input_ids": ids, "labels": ids}, 0.8)
    wrapper = torch.nn.ModuleDict({"lm": model})  # as PEFT's or a user's module holds it
    with pytest.raises(ValueError, match="ModuleDict has transformers' own activation checkpointing on"):
        optremat.plan(wrapper, {"input_ids": ids, "labels": ids}, 0.8)


def refusal(accelerator: object) -> str:
    """What `Prepare` says when it refuses `accelerator`, before planning anything."""
    try:
        Prepare(0.8)(accelerator, torch.nn.Linear(4, 4), batch=torch.ones(4))
    except ValueError as error:
        return str(error)
    return ""


def fsdp2_rank(budget: float) -> dict:
    """One rank of two stepping a Llama (untied embeddings) that accelerate's FSDP2 plugin
    shards, once as accelerate prepares it and once prepared under optremat's plan (made
    on the first batch of the DataLoader prepared with it): the losses, rank 0's whole
    gradients, the plan, this rank's measured peak, and what `Prepare` said refusing the
    Accelerator before it ran FSDP2 and with the plugin's own checkpointing on.
    accelerate turns FSDP on only on accelerators (on CPUs its Accelerator runs DDP), so
    the distributed type is set to FSDP by hand: its FSDP2 preparation then runs on gloo."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    out = {"refused": [refusal(accelerator)]}
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    plugin.activation_checkpointing = True
    out["refused"].append(refusal(accelerator))
    plugin.activation_checkpointing = False
    ids = torch.randint(0, 2000, (2, 128), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids}
    for name in ("plain", "planned"):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          use_cache=False)
        model = transformers.LlamaForCausalLM(config).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if name == "plain":
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            prepare = Prepare(budget, time_limit=5, deterministic=True)
            loader = torch.utils.data.DataLoader(Tokens(8, 128), batch_size=2)
            model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            return outputs.loss

        out[name] = {"loss": step().item(), "gradients": whole_gradients(model)}
        if name == "planned":
            out.update(plan=prepare.plan, peak=rank_peak(model, model, batch, step))
        optimizer.step()
        out[name]["trained"] = []
        for _ in range(2):
            out[name]["trained"].append(step().item())
            optimizer.step()
    return out


def test_accelerate_fsdp2_prepares_a_planned_model_that_trains_the_same() -> None:
    """The plan runs the model's own head and loss in token chunks inside the FSDP2 group
    accelerate makes of the final norm and the head (before, FSDP2's hooks on the head
    made it run whole: the plan at half the peak measured 1.96 times its prediction)."""
    ranks = run_local(fsdp2_rank, 2, 0.5)
    without_fsdp2, checkpointing = ranks[0]["refused"]
    assert "FullyShardedDataParallelPlugin(fsdp_version=2)" in without_fsdp2
    assert "without activation_checkpointing=True" in checkpointing
    plans = [rank["plan"] for rank in ranks]
    assert plans[0].regions and plans[0].regions == plans[1].regions
    assert plans[0].chunking.chunks is not None and plans[0].chunking == plans[1].chunking
    assert plans[0].parallel.groups == (("model.norm", "lm_head"),)
    assert plans[0].parallel.units == ("model.layers.0", "model.layers.1", "model.layers.2", "model.embed_tokens")
    for rank in ranks:
        np.testing.assert_allclose(rank["planned"]["loss"], rank["plain"]["loss"], rtol=1e-6)
        np.testing.assert_allclose(rank["planned"]["trained"], rank["plain"]["trained"], rtol=1e-5)
        plan, measured = rank["plan"], rank["peak"]
        assert measured <= 1.02 * plan.budget_bytes, (measured, plan.summary())
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, (measured, plan.summary())
    for name, grad in ranks[0]["plain"]["gradients"].items():
        np.testing.assert_allclose(ranks[0]["planned"]["gradients"][name], grad, rtol=1e-5, atol=1e-7, err_msg=name)
