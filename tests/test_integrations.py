"""optremat where users turn checkpointing on today: transformers' Trainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from optremat.integrations.transformers import PlanCallback  # noqa: E402 - after the skips


class Tokens(torch.utils.data.Dataset):
    """Random token sequences as a causal LM trains on them: input_ids and labels."""

    def __init__(self, count: int, length: int) -> None:
        self.ids = torch.randint(0, 2000, (count, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(tmp_path, callbacks: list, checkpointing: bool = False) -> list[float]:
    """Losses of three Trainer steps of a GPT-2 from its config, seeded alike."""
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=2000, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                          seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(12, 128), callbacks=callbacks)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_the_trainer_callback_plans_on_the_first_batch_and_trains_the_same(tmp_path) -> None:
    want = train(tmp_path / "plain", [])
    callback = PlanCallback(0.7, cache=tmp_path / "plans", time_limit=5)
    got = train(tmp_path / "planned", [callback])
    assert callback.plan is not None and callback.plan.regions
    assert "the model's own" in callback.plan.summary()
    assert got == want
    again = PlanCallback(0.7, cache=tmp_path / "plans", time_limit=5)
    train(tmp_path / "again", [again])
    assert again.plan.cached


def test_the_callback_refuses_a_model_with_transformers_own_checkpointing(tmp_path) -> None:
    with pytest.raises(ValueError, match="own activation checkpointing"):
        train(tmp_path, [PlanCallback(0.7, time_limit=5)], checkpointing=True)
