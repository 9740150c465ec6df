"""The README's promises: its quickstarts run as written, it stays short, its links and the
documentation's lead to files that exist, and the transformers models its support table
names plan and train exactly."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import torch

import optremat

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_BYTES = 12_000

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def runs_here(code: str) -> bool:
    """A quickstart that needs neither a GPU, a process group nor the network."""
    return ("optremat.plan(" in code and "torch.distributed" not in code and "torch.compile(" not in code
            and "cuda" not in code and "from_pretrained(" not in code.split("#")[0])


QUICKSTARTS = [code for code in blocks(README, "python") if runs_here(code)]


def test_the_readme_has_the_two_quickstarts_that_run_without_a_gpu_or_a_process_group() -> None:
    assert len(QUICKSTARTS) == 2, "the plain loop and the transformers quickstart"
    assert "loss_fn=" in QUICKSTARTS[0] and "optremat.apply(" in QUICKSTARTS[0]
    assert '"labels"' in QUICKSTARTS[1] and "loss_fn" not in QUICKSTARTS[1]


@pytest.mark.parametrize("code", QUICKSTARTS, ids=["plain-loop", "transformers-dict-batch"])
def test_a_readme_quickstart_runs_as_written_and_makes_a_plan(code: str, tmp_path, monkeypatch) -> None:
    if "import transformers" in code or "import torch, transformers" in code:
        pytest.importorskip("transformers")
    plan = optremat.plan

    @functools.wraps(plan)
    def quick(*args, **kwargs):
        """`optremat.plan` with a short, machine-independent search, as the suite runs it."""
        kwargs.setdefault("time_limit", 2)
        kwargs.setdefault("deterministic", True)
        return plan(*args, **kwargs)

    monkeypatch.setattr(optremat, "plan", quick)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    made = namespace["plan"]
    assert isinstance(made, optremat.Plan) and (made.regions or made.chunking is not None and made.chunking.chunks)
    assert made.predicted_peak_bytes <= made.budget_bytes


def test_the_readme_starts_with_the_two_setup_commands() -> None:
    first = blocks(README, "bash")[0].splitlines()
    assert first == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[test]' "
        "&& optremat plan --model gpt-small --budget 0.7 --progress",
        "python -m pytest -q",
    ]
    assert README.read_text().index("```bash") < README.read_text().index("```python")


def test_the_readme_is_short() -> None:
    assert README.stat().st_size <= MAX_README_BYTES


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page."""
    text = FENCE.sub("", path.read_text())
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_that_exists(page: Path) -> None:
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def exact_training(model: torch.nn.Module, batch: dict) -> None:
    """Planned at 0.7 without a loss_fn, its LM head whole, the model trains with the
    unplanned model's loss and gradients, bit for bit (a head run in chunks sums the loss
    in another order: tests/test_hf_chunked.py)."""

    def step(m: torch.nn.Module) -> tuple[float, dict]:
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(5)
        loss = m(**batch).loss
        loss.backward()
        return loss.item(), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}

    want = step(copy.deepcopy(model))
    plan = optremat.plan(model, batch, 0.7, time_limit=5, deterministic=True, head_chunks=None)
    assert plan.regions and "the model's own" in plan.summary()
    got = step(optremat.apply(model, plan))
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_t5_from_its_config_plans_and_trains_exactly() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).train()
    exact_training(model, {"input_ids": torch.randint(1, 512, (4, 64)), "labels": torch.randint(1, 512, (4, 32))})


@pytest.mark.slow
def test_qwen2_from_its_config_plans_and_trains_exactly() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, 512, (4, 128))
    exact_training(model, {"input_ids": ids, "labels": ids})
