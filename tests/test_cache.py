"""The offline plan cache, through plan(cache=...) and the CLI."""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn

import optremat
from optremat.ilp.region_cpsat import RegionSolution
from optremat.planners.regions import parse_span
from optremat.planning import model as planning
from optremat.planning import native as native_plan
from tests.console import Ran, run

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


def test_a_model_whose_edited_code_rules_calls_out_is_another_entry(tmp_path) -> None:
    """A block edited to draw from Python's random numbers (the same class name,
    parameters and ops) got the plan cached for its pure version, checkpointing calls a
    plan made afresh never checkpoints: the key now holds which calls plans may
    checkpoint, and the buffers the step writes."""
    def build(drawing: bool) -> nn.Module:
        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Linear(32, 128), nn.Linear(128, 32)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                scale = random.uniform(0.5, 1.0) if drawing else 0.75
                return x + self.b(torch.tanh(self.a(x)) * scale)

        torch.manual_seed(0)
        return nn.Sequential(*[Block() for _ in range(6)], nn.Linear(32, 32))

    x = torch.randn(512, 32)
    first = optremat.plan(build(False), (x,), 0.7, loss_fn=lambda out: out.square().mean(), time_limit=5,
                          deterministic=True, cache=tmp_path)
    assert any(parse_span(r.path) is not None or r.path in "012345" for r in first.regions)
    with pytest.warns(UserWarning, match="random numbers"), pytest.raises(optremat.InfeasibleBudget,
                                                                         match=r"no plan checkpoints 0 \(call 0\)"):
        optremat.plan(build(True), (x,), 0.7, loss_fn=lambda out: out.square().mean(), time_limit=5,
                      deterministic=True, cache=tmp_path)


def same_plan(a: optremat.Plan, b: optremat.Plan) -> bool:
    """Whether two plans decide and price alike (all but how long their search took)."""
    def content(p: optremat.Plan) -> dict:
        return {k: v for k, v in p.to_json().items() if k not in ("solve_seconds", "checksum")}
    return content(a) == content(b)


def test_corrupted_entry_is_reported_and_solved_again(tmp_path) -> None:
    """A corrupted entry warns and is planned again; in deterministic time the search
    finds the same plan again, whatever the machine's load."""
    model, inputs, loss_fn = build()
    options = dict(loss_fn=loss_fn, time_limit=2, deterministic=True, cache=tmp_path)
    first = optremat.plan(model, inputs, 0.7, **options)
    (entry,) = tmp_path.glob("*.plan.json")
    text = entry.read_text()
    entry.write_text(text[: len(text) // 2])
    with pytest.warns(UserWarning, match="corrupted"):
        again = optremat.plan(model, inputs, 0.7, **options)
    assert not again.cached and same_plan(again, first)
    body = json.loads(entry.read_text())
    body["plan"]["predicted_peak_bytes"] += 1
    entry.write_text(json.dumps(body))
    with pytest.warns(UserWarning, match="checksum"):
        assert not optremat.plan(model, inputs, 0.7, **options).cached
    assert same_plan(optremat.plan(model, inputs, 0.7, **options), first)
    assert optremat.plan(model, inputs, 0.7, **options).cached


def with_plan(entry: dict[str, Any], plan: Any) -> dict[str, Any]:
    """A cache entry holding `plan`, with the checksum the cache keeps of it recomputed."""
    text = json.dumps(plan, sort_keys=True)
    return {**entry, "plan": plan, "checksum": hashlib.sha256(text.encode()).hexdigest()}


MALFORMED_ENTRIES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "a list": lambda entry: [1, 2, 3],
    "null": lambda entry: None,
    "text": lambda entry: "text",
    "no time limit": lambda entry: {k: v for k, v in entry.items() if k != "time_limit"},
    "a time limit as text": lambda entry: {**entry, "time_limit": "2"},
    "the plan a list": lambda entry: with_plan(entry, []),
    "a plan without status": lambda entry: with_plan(entry, {k: v for k, v in entry["plan"].items() if k != "status"}),
    "a status as a number": lambda entry: with_plan(entry, {**entry["plan"], "status": 1}),
}


def test_an_entry_of_any_malformed_shape_is_reported_and_solved_again(tmp_path) -> None:
    """Valid JSON that is not an intact entry (not an object, a field missing or of the
    wrong type) is corrupted like a truncated one: a warning, the plan made again and
    stored again; `cache list` shows it as CORRUPTED."""
    model, inputs, loss_fn = build()
    options = dict(loss_fn=loss_fn, time_limit=2, deterministic=True, cache=tmp_path)
    first = optremat.plan(model, inputs, 0.7, **options)
    (entry,) = tmp_path.glob("*.plan.json")
    intact = json.loads(entry.read_text())
    for name, malformed in MALFORMED_ENTRIES.items():
        entry.write_text(json.dumps(malformed(intact)))
        assert "CORRUPTED" in run("cache", "list", "--dir", str(tmp_path)).stdout, name
        with pytest.warns(UserWarning, match=f"plan cache entry {entry} is corrupted"):
            again = optremat.plan(model, inputs, 0.7, **options)
        assert not again.cached and same_plan(again, first), name
        assert optremat.plan(model, inputs, 0.7, **options).cached, name


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

    (entry,) = tmp_path.glob("*.plan.json")
    stale = tmp_path / f".{entry.name}.4242.tmp"
    stale.write_text(entry.read_text()[:100])
    mine = tmp_path / "my_model.plan.json"  # a plan the user saved there: not the cache's to list or remove
    optremat.plan(model, inputs, 0.7, loss_fn=loss_fn, time_limit=5).save(mine)
    listed = cli("list")
    assert listed.returncode == 0 and "1 plans in" in listed.stdout
    cleared = cli("clear")
    assert cleared.returncode == 0 and "removed 1 plans" in cleared.stdout
    assert "0 plans in" in cli("list").stdout
    assert list(tmp_path.iterdir()) == [mine], "clear leaves no entry, lock or unfinished write behind"


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Makes a directory read-only: its mode, and, for root (whom modes do not stop),
    every attempt to create, replace or remove a file in it fails as it does for others."""
    made: list[Path] = []

    def refused(path: Any) -> OSError:
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def inside(path: Any) -> bool:
        return isinstance(path, (str, os.PathLike)) and any(Path(path).parent == d for d in made)

    def guarded(call: Callable, writes: Callable[..., bool]) -> Callable:
        def call_unless_refused(*args: Any, **kwargs: Any) -> Any:
            if writes(*args, **kwargs):
                raise refused(args[0])
            return call(*args, **kwargs)
        return call_unless_refused

    def opens_for_writing(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> bool:
        return inside(file) and any(c in mode for c in "wax+")

    def touches(*paths: Any, **kwargs: Any) -> bool:
        return any(inside(p) for p in paths[:2])

    def make(directory: Path) -> None:
        directory.chmod(0o555)
        made.append(directory)
        with pytest.raises(PermissionError):
            (directory / "probe").write_text("")

    if os.geteuid() == 0:
        monkeypatch.setattr(builtins, "open", guarded(builtins.open, opens_for_writing))
        monkeypatch.setattr(io, "open", guarded(io.open, opens_for_writing))
        for name in ("replace", "rename", "unlink"):
            monkeypatch.setattr(os, name, guarded(getattr(os, name), touches))
    yield make
    for directory in made:
        directory.chmod(0o755)


def test_a_read_only_cache_serves_its_entries(tmp_path, monkeypatch, read_only) -> None:
    """A cache shared read-only (no lock file, no right to make one) loads its entry."""
    model, inputs, loss_fn = build()
    options = dict(loss_fn=loss_fn, time_limit=2, deterministic=True, cache=tmp_path)
    first = optremat.plan(model, inputs, 0.7, **options)
    for lock in tmp_path.glob("*.lock"):
        lock.unlink()
    read_only(tmp_path)

    def no_solver(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cache hit must not run any solver")

    monkeypatch.setattr(planning, "solve_native", no_solver)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hit = optremat.plan(model, inputs, 0.7, **options)
    assert hit.cached and hit.to_json() == first.to_json()
    assert [p.name for p in tmp_path.iterdir()] == [f"{key_of(tmp_path)}.plan.json"]


def key_of(directory: Path) -> str:
    (entry,) = directory.glob("*.plan.json")
    return entry.name.removesuffix(".plan.json")


def test_a_plan_the_cache_cannot_store_is_returned_with_a_warning(tmp_path, read_only) -> None:
    """A read-only cache, and an entry's place taken by a directory (its write fails after
    the temporary file is written): the solved plan is returned, the warning names the
    cache and the OS error, and no temporary file is left."""
    model, inputs, loss_fn = build()
    options = dict(loss_fn=loss_fn, time_limit=2, deterministic=True)
    writable = tmp_path / "writable"
    first = optremat.plan(model, inputs, 0.7, cache=writable, **options)
    locked = tmp_path / "locked"
    locked.mkdir()
    read_only(locked)
    with pytest.warns(UserWarning, match=f"could not store the plan in the plan cache {locked} .*Permission denied"):
        found = optremat.plan(model, inputs, 0.7, cache=locked, **options)
    assert not found.cached and same_plan(found, first)
    assert list(locked.iterdir()) == []

    taken = tmp_path / "taken"
    (taken / f"{key_of(writable)}.plan.json").mkdir(parents=True)
    with pytest.warns(UserWarning) as caught:
        found = optremat.plan(model, inputs, 0.7, cache=taken, **options)
    assert not found.cached and same_plan(found, first)
    messages = [str(w.message) for w in caught]
    assert any(f"could not store the plan in the plan cache {taken}" in m for m in messages), messages
    assert not list(taken.glob(".*.tmp"))


def test_an_entry_of_another_cache_format_is_planned_again_quietly(tmp_path) -> None:
    model, inputs, loss_fn = build()
    options = dict(loss_fn=loss_fn, time_limit=2, deterministic=True, cache=tmp_path)
    first = optremat.plan(model, inputs, 0.7, **options)
    (entry,) = tmp_path.glob("*.plan.json")
    body = json.loads(entry.read_text())
    entry.write_text(json.dumps({**body, "format": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = optremat.plan(model, inputs, 0.7, **options)
    assert not again.cached and same_plan(again, first)
    assert json.loads(entry.read_text())["format"] == body["format"]
    assert optremat.plan(model, inputs, 0.7, **options).cached
