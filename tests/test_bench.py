"""The head-to-head comparison users run with `optremat bench`: peers run correctly and
optremat is measured at each peer's peak."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import run

from optremat.bench import PLANNERS, checkpointed_blocks, compare, repeated_blocks, torch_budget_backend
from optremat.models import build


def grads(module, model, inputs, loss_fn):
    params = [p for p in model.parameters()]
    return torch.autograd.grad(loss_fn(module(*inputs)), params)


def test_per_block_checkpointing_finds_the_blocks_keeps_gradients_and_restores_the_model():
    example = build("gpt-tiny", dtype=torch.float64)
    model = example.model
    blocks = repeated_blocks(model)
    assert blocks == ["blocks.0", "blocks.1"]
    assert repeated_blocks(build("resnet-tiny").model) == ["layers.0", "layers.1", "layers.2"]
    assert repeated_blocks(build("mlp-tiny").model) == []
    want = grads(model, model, example.inputs, example.loss_fn)
    with checkpointed_blocks(model, blocks):
        assert "forward" in vars(model.get_submodule("blocks.0"))
        got = grads(model, model, example.inputs, example.loss_fn)
    assert "forward" not in vars(model.get_submodule("blocks.0"))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_torch_budget_backend_compiles_with_its_own_budget_and_keeps_gradients():
    example = build("mlp-tiny", dtype=torch.float64)
    model = example.model
    want = grads(model, model, example.inputs, example.loss_fn)
    for budget in (1.0, 0.0):
        compiled = torch.compile(model, backend=torch_budget_backend(budget))
        for g, w in zip(grads(compiled, model, example.inputs, example.loss_fn), want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    import torch._functorch.config as functorch_config
    assert functorch_config.activation_memory_budget == 1.0, "the budget must not leak into the global config"


def test_compare_measures_optremat_at_each_peers_peak():
    example = build("resnet-tiny")
    seen = []
    results = compare(example.model, example.inputs, example.loss_fn, torch_budgets=(), fractions=(0.9,), runs=1,
                      time_limit=5, report=seen.append)
    assert seen == results
    methods = [r.method for r in results]
    assert methods[:2] == ["no remat", "checkpoint 3 blocks"]
    unplanned, blocks = results[0], results[1]
    assert blocks.peak_bytes < unplanned.peak_bytes
    planned = [r for r in results if r.method == "optremat"]
    assert [r.matches for r in planned] == ["checkpoint 3 blocks", "90% of unplanned"]
    for r in planned:
        if r.ran:
            budget = blocks.peak_bytes if r.matches == blocks.method else 0.9 * unplanned.peak_bytes
            assert r.predicted_peak_bytes <= budget
            assert r.peak_bytes <= 1.02 * r.predicted_peak_bytes, "measured peak strays from the prediction"
            assert r.baseline == "eager" and r.predicted_overhead >= 0 and math.isfinite(r.overhead)
        else:
            assert "infeasible" in r.note
    assert any(r.ran for r in planned)


def test_bench_command_simulated_table_as_json(tmp_path):
    result = run("bench", "--model", "vgg-tiny", "--budgets", "0.99,0.5", "--no-measure", "--json",
                 "--time-limit", "3", "--plot", str(tmp_path / "b.png"))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(r["fraction"], r["planner"]) for r in data["simulated"]] == [(f, p) for f in (0.99, 0.5) for p in PLANNERS]
    assert data["measured"] == []
    auto = {r["fraction"]: r for r in data["simulated"] if r["planner"] == "auto"}
    assert auto[0.99]["overhead"] is not None and auto[0.99]["overhead"] >= 0
    assert auto[0.5]["overhead"] is None and auto[0.5]["note"].startswith("infeasible (min ")
    assert (tmp_path / "b.png").stat().st_size > 0


@pytest.mark.parametrize("flag", [["--budgets", "1.5"], ["--torch-budgets", "x"]])
def test_bench_command_rejects_bad_budgets(flag):
    result = run("bench", "--model", "mlp-tiny", "--no-measure", *flag)
    assert result.returncode == 2 and "error" in result.stderr


def test_the_gpu_benchmark_runs_its_smoke_configuration_on_the_cpu():
    """`python -m benchmarks.gpu --smoke`: both dtypes' rows, optremat's plans at per-block
    checkpointing's peak and at the chunked PyTorch loss's measured (or refused, naming
    the smallest budget, and then made at that budget)."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke"], cwd=root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if " | " in line]
    for dtype in ("bfloat16", "float32"):
        ours = [row for row in rows if row[0] == dtype and row[1] == "optremat"]
        labels = [row[2].split(" (")[0] for row in ours]
        lce = "= per-block checkpoint + F.linear_cross_entropy"
        assert labels[:2] == ["= per-block checkpoint", lce]
        assert labels[2:] == ([f"{lce}, least peak found"] if ours[1][5].startswith("infeasible") else [])
        assert all(row[6] != "-" or row[5].startswith("infeasible") for row in ours)
