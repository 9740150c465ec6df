"""The offline plan cache, through plan(cache=...) and the CLI."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch.nn as nn

import optremat
from optremat.ilp.region_cpsat import RegionSolution
from tests.console import Ran, run

planning = importlib.import_module("optremat.planning")
native_plan = importlib.import_module("optremat.native_plan")

MODEL = textwrap.dedent("""
    import torch, torch.nn as nn
    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(8):
            layers += [nn.Linear(64, 64), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(64, 4)), (torch.randn(256, 64),), lambda out: out.pow(2).mean()
""")


def build() -> tuple[nn.Module, tuple, callable]:
    scope: dict = {}
    exec(MODEL, scope)
    return scope["build"]()


def test_hit_loads_the_same_plan_without_solving(tmp_path, monkeypatch) -> None:
    model, inputs, loss_fn = build()
    first = optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path)
    assert not first.cached

    def no_solver(*args, **kwargs):
        raise AssertionError("a cache hit must not run any solver")

    monkeypatch.setattr(planning, "solve_native", no_solver)
    second = optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path)
    assert second.cached and second.to_json() == first.to_json()
    out = optremat.apply(model, second)(*inputs)
    assert out.shape == (256, 4)


def test_another_budget_or_solver_is_another_entry(tmp_path) -> None:
    model, inputs, loss_fn = build()
    optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path)
    optremat.plan(model, inputs, 0.8, loss_fn=loss_fn, time_limit=5, cache=tmp_path)
    optremat.plan(model, inputs, 0.8, loss_fn=loss_fn, solver="greedy", cache=tmp_path)
    assert len(list(tmp_path.glob("*.plan.json"))) == 3


def test_corrupted_entry_is_reported_and_solved_again(tmp_path, monkeypatch) -> None:
    """A corrupted entry warns and is planned again, as cheaply (the parallel search may
    return another plan of the same cost)."""
    model, inputs, loss_fn = build()
    first = optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path)
    (entry,) = tmp_path.glob("*.plan.json")
    text = entry.read_text()
    entry.write_text(text[: len(text) // 2])
    with pytest.warns(UserWarning, match="corrupted"):
        again = optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path)
    assert not again.cached and again.predicted_overhead == pytest.approx(first.predicted_overhead, abs=1e-6)
    body = json.loads(entry.read_text())
    body["plan"]["predicted_peak_bytes"] += 1
    entry.write_text(json.dumps(body))
    with pytest.warns(UserWarning, match="checksum"):
        assert not optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path).cached
    assert optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path).cached


def test_unproven_plan_is_reused_only_without_more_time(tmp_path, monkeypatch) -> None:
    """A plan whose search ran out of time before proving anything (as on a large model)
    is reused by calls allowing no more time, and planned again by one allowing more."""
    monkeypatch.setattr(native_plan, "solve_regions", lambda *args, **kwargs: RegionSolution(None, None, False))
    model, inputs, loss_fn = build()
    first = optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, solver="greedy", time_limit=2, cache=tmp_path)
    assert first.status != "OPTIMAL"
    assert optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, solver="greedy", time_limit=2, cache=tmp_path).cached
    assert optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, solver="greedy", time_limit=1, cache=tmp_path).cached
    assert not optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, solver="greedy", time_limit=9,
                             cache=tmp_path).cached


def test_two_processes_planning_one_key_share_one_entry(tmp_path) -> None:
    script = tmp_path / "plan_it.py"
    script.write_text(MODEL + textwrap.dedent(f"""
        import json, optremat
        model, inputs, loss_fn = build()
        p = optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache={str(tmp_path / "cache")!r})
        print(json.dumps({{"peak": p.predicted_peak_bytes, "cached": p.cached}}))
    """))
    processes = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["peak"] == results[1]["peak"]
    assert sorted(r["cached"] for r in results) == [False, True]
    entries = list((tmp_path / "cache").glob("*.plan.json"))
    assert len(entries) == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    optremat.Plan.from_json(json.loads(entries[0].read_text())["plan"])


def test_cli_cache_list_and_clear(tmp_path) -> None:
    model, inputs, loss_fn = build()
    optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5, cache=tmp_path)

    def cli(*args: str) -> Ran:
        return run("cache", *args, "--dir", str(tmp_path))

    listed = cli("list")
    assert listed.returncode == 0 and "1 plans in" in listed.stdout
    cleared = cli("clear")
    assert cleared.returncode == 0 and "removed 1 plans" in cleared.stdout
    assert "0 plans in" in cli("list").stdout
