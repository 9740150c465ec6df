"""Plan files, budgets and plan() options: every bad input is refused with an error that
says what is wrong and what to do, never a crash from inside and never another plan."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn

import optremat
from optremat.models import build
from optremat.planning import model as planning
from optremat.planning.result import Chunking
from tests.dags import training_chain


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[optremat.Plan, dict[str, Any]]:
    """A plan of resnet-tiny (its regions include a span of a Sequential) and the JSON
    its file holds."""
    example = build("resnet-tiny")
    found = optremat.plan(example.model, example.inputs, 0.9, loss_fn=example.loss_fn, time_limit=2,
                          deterministic=True)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    found.save(path)
    return found, json.loads(path.read_text())


def resigned(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the checksum a plan file carries recomputed for its content: sha256 of
    its canonical JSON, every key but the checksum, sorted, without spaces."""
    content = {k: v for k, v in data.items() if k != "checksum"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return {**content, "checksum": hashlib.sha256(text.encode()).hexdigest()}


def edited(data: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    edit(changed)
    return changed


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_plan_round_trips_through_its_file_with_a_checksum(saved, tmp_path) -> None:
    found, data = saved
    assert data["version"] == 6 and len(data["checksum"]) == 64 and data["chunking"] is None
    assert resigned(data)["checksum"] == data["checksum"]
    assert any(path.endswith("]") for path, _, _ in data["regions"])
    found.save(tmp_path / "again.json")
    loaded = optremat.Plan.load(tmp_path / "again.json")
    assert loaded.to_json() == found.to_json() == data
    assert loaded.regions == found.regions and loaded.mutated_buffers == found.mutated_buffers
    assert [p.name for p in tmp_path.iterdir()] == ["again.json"]


EDITS = {
    "a region's call index": lambda d: d["regions"][0].__setitem__(1, d["regions"][0][1] + 1),
    "mutated buffers emptied": lambda d: d.__setitem__("mutated_buffers", []),
    "a region path renamed": lambda d: d["regions"][0].__setitem__(0, d["regions"][0][0] + "x"),
    "the budget": lambda d: d.__setitem__("budget_bytes", d["budget_bytes"] * 2),
    "a graph size": lambda d: d["graph"]["size"].__setitem__(0, d["graph"]["size"][0] + 1),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_a_file_changed_after_it_was_saved_is_refused(saved, tmp_path, edit) -> None:
    _, data = saved
    path = write(tmp_path / "plan.json", edited(data, edit))
    with pytest.raises(optremat.PlanFileError, match="changed after it was saved") as error:
        optremat.Plan.load(path)
    assert str(path) in str(error.value) and "plan again" in str(error.value)


@pytest.mark.parametrize("version", [3, 4])
def test_older_formats_are_refused_with_plan_again(saved, tmp_path, version) -> None:
    _, data = saved
    old = {k: v for k, v in data.items() if k != "checksum"}
    path = write(tmp_path / "old.json", {**old, "version": version})
    with pytest.raises(optremat.PlanFileError, match=f"plan format version {version} is not supported.*plan again"):
        optremat.Plan.load(path)


def test_a_version_5_file_reads_as_a_plan_without_chunking(saved, tmp_path) -> None:
    """Version 6 added `chunking`; a file of version 5 lacks the key and still loads."""
    found, data = saved
    old = {k: v for k, v in data.items() if k not in ("checksum", "chunking")}
    loaded = optremat.Plan.load(write(tmp_path / "v5.json", resigned({**old, "version": 5})))
    assert loaded.chunking is None and loaded.regions == found.regions
    with pytest.raises(optremat.PlanFileError, match=r"unexpected keys \['chunking'\]"):
        optremat.Plan.load(write(tmp_path / "v5.json", resigned({**data, "version": 5})))


CHUNKING = {"head": "tok.weight", "chunks": 8, "unplanned_peak_bytes": 1000, "tried": [None, 2, 8]}


def test_a_files_chunking_is_read_back_and_checked(saved, tmp_path) -> None:
    _, data = saved
    loaded = optremat.Plan.load(write(tmp_path / "chunked.json", resigned({**data, "chunking": CHUNKING})))
    assert loaded.chunking == Chunking("tok.weight", 8, 1000, (None, 2, 8))
    assert loaded.to_json()["chunking"] == CHUNKING and "in 8 token chunks" in loaded.summary()
    for bad, message in (({**CHUNKING, "chunks": 0}, "chunking 'chunks' must be"),
                         ({"head": "tok.weight"}, "chunking must have the keys")):
        with pytest.raises(optremat.PlanFileError, match=message):
            optremat.Plan.load(write(tmp_path / "bad.json", resigned({**data, "chunking": bad})))


def test_a_file_that_is_not_json_or_not_an_object_is_refused(tmp_path) -> None:
    (tmp_path / "broken.json").write_text('{"format": "optremat.plan", "version": ')
    with pytest.raises(optremat.PlanFileError, match="broken.json is not valid JSON"):
        optremat.Plan.load(tmp_path / "broken.json")
    for value, kind in (([1, 2], "a list"), ("plan", "the text 'plan'"), (None, "null"), (7, "7")):
        with pytest.raises(optremat.PlanFileError, match=f"one JSON object, not {kind}"):
            optremat.Plan.load(write(tmp_path / "other.json", value))
        with pytest.raises(optremat.PlanFileError, match="one JSON object"):
            optremat.Plan.from_json(value)
    with pytest.raises(optremat.PlanFileError, match="not an optremat plan"):
        optremat.Plan.load(write(tmp_path / "graph.json", training_chain([1.0], [8]).to_json()))


MALFORMED = {
    "no checksum": (lambda d: d.pop("checksum"), False, "carries no checksum"),
    "a missing key": (lambda d: d.pop("loss"), True, r"lacks the keys \['loss'\]"),
    "an unexpected key": (lambda d: d.__setitem__("notes", "mine"), True, r"unexpected keys \['notes'\]"),
    "budget as text": (lambda d: d.__setitem__("budget_bytes", "lots"), True,
                       "'budget_bytes' must be a whole number of bytes > 0, not the text 'lots'"),
    "budget as a bool": (lambda d: d.__setitem__("budget_bytes", True), True, "'budget_bytes' must be"),
    "regions an object": (lambda d: d.__setitem__("regions", {}), True, "'regions' must be a list of"),
    "a negative call": (lambda d: d["regions"][0].__setitem__(1, -1), True, "'regions' must be"),
    "a region of two items": (lambda d: d["regions"][0].pop(), True, "'regions' must be"),
    "a buffer name as a number": (lambda d: d.__setitem__("mutated_buffers", [3]), True, "'mutated_buffers'"),
    "training as text": (lambda d: d.__setitem__("training", "yes"), True, "'training' must be true or false"),
    "a bound as text": (lambda d: d.__setitem__("lower_bound", "0.1"), True, "'lower_bound' must be a number"),
    "an unknown runtime": (lambda d: d.__setitem__("runtime", "eager"), True, "'runtime' must be one of native"),
    "a share of one item": (lambda d: d.__setitem__("shared", [[1]]), True, "'shared' must be"),
    "a share of an event past the schedule": (lambda d: d.__setitem__("shared", [[len(d["schedule"]["events"]), 0]]),
                                              True, r"'shared' pair \[\d+, 0\] names an event or node the plan lacks"),
    "a share of a node past the graph": (lambda d: d.__setitem__("shared", [[0, len(d["graph"]["names"])]]), True,
                                         r"'shared' pair \[0, \d+\] names an event or node the plan lacks"),
    "a schedule of no stages": (lambda d: d["schedule"].__setitem__("num_stages", 0), True,
                                r"schedule 'num_stages' is 0 for a graph of \d+ nodes"),
    "a schedule of a stage too many": (lambda d: d["schedule"].__setitem__("num_stages", len(d["graph"]["names"]) + 1),
                                       True, "schedule 'num_stages' is"),
    "a rival without numbers": (lambda d: d.__setitem__("compared", [["greedy"]]), True, "'compared' must be"),
    "the graph a list": (lambda d: d.__setitem__("graph", []), True, "'graph' must be an object"),
    "the graph without columns": (lambda d: d.__setitem__("graph", {"format": "optremat.graph",
                                                                    "version": d["graph"]["version"]}),
                                  True, "the plan's graph is malformed"),
    "a graph column too short": (lambda d: d["graph"]["names"].pop(), True, "the plan's graph is malformed"),
    "schedule events as text": (lambda d: d["schedule"].__setitem__("events", "none"), True,
                                "the plan's schedule is malformed"),
    "a reversed span": (lambda d: d["regions"].append(["stem[2:0]", 0, []]), True, r"'stem\[2:0\]' has a bad span"),
    "a span with a dash": (lambda d: d["regions"].append(["stem[0-2]", 0, []]), True, "has a bad span"),
    "a span of names": (lambda d: d["regions"].append(["stem[a:b]", 0, []]), True, "has a bad span"),
    "an unclosed span": (lambda d: d["regions"].append(["stem[0:2", 0, []]), True, "has a bad span"),
    "an unknown parallel kind": (lambda d: d.__setitem__("parallel", {"kind": "ZeRO", "world": 2}), True,
                                 "parallel kind must be one of FSDP, DDP, not the text 'ZeRO'"),
    "a parallel kind as a list": (lambda d: d.__setitem__("parallel", {"kind": ["DDP"]}), True,
                                  "parallel kind must be one of FSDP, DDP, not a list"),
    "a parallel field missing": (lambda d: d.__setitem__("parallel", {"kind": "DDP", "world": 2}), True,
                                 r"parallel \(DDP\) must have the keys"),
    "a parallel world as text": (lambda d: d.__setitem__("parallel", {"kind": "DDP", "world": "8",
                                                                       "optimizer_state": 0.0}), True,
                                 "parallel 'world' must be a whole number >= 0, not the text '8'"),
    "parallel a list": (lambda d: d.__setitem__("parallel", ["DDP"]), True, "'parallel' must be null or an object"),
}


@pytest.mark.parametrize("edit, resign, says", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_file_is_refused_naming_what_is_wrong(saved, tmp_path, edit, resign, says) -> None:
    """Files written by hand or by another program, with a checksum that matches (else
    they read as changed after saving): one error type, naming the file and the fault."""
    _, data = saved
    bad = edited(data, edit)
    path = write(tmp_path / "plan.json", resigned(bad) if resign else bad)
    with pytest.raises(optremat.PlanFileError, match=says) as error:
        optremat.Plan.load(path)
    assert str(error.value).startswith(f"plan file {path}: ")
    assert isinstance(error.value, ValueError)


def test_a_parallel_job_round_trips(saved, tmp_path) -> None:
    _, data = saved
    fsdp = {"kind": "FSDP", "units": ["layers.*"], "world": 8, "reshard_after_forward": False,
            "optimizer_state": 2.0}
    loaded = optremat.Plan.load(write(tmp_path / "plan.json", resigned({**data, "parallel": fsdp})))
    assert loaded.parallel == optremat.FSDP(units=("layers.*",), world=8, reshard_after_forward=False,
                                            optimizer_state=2.0)
    grouped = {**fsdp, "groups": [["norm", "lm_head"]]}
    loaded = optremat.Plan.load(write(tmp_path / "grouped.json", resigned({**data, "parallel": grouped})))
    assert loaded.parallel.groups == (("norm", "lm_head"),)
    assert optremat.Plan.from_json(loaded.to_json()).parallel == loaded.parallel


def test_save_to_a_missing_directory_or_over_a_directory_names_the_path_and_leaves_nothing(saved, tmp_path) -> None:
    found, _ = saved
    missing = tmp_path / "no" / "such" / "plan.json"
    with pytest.raises(FileNotFoundError, match=f"cannot write {missing}: its directory {missing.parent} "
                                                "does not exist"):
        found.save(missing)
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'taken'}"):
        found.save(tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and not any((tmp_path / "taken").iterdir())


def test_budget_strings_are_the_numbers_they_spell_and_numpy_numbers_count() -> None:
    graph = training_chain([1.0] * 6, [8] * 6)
    half = optremat.resolve_budget(graph, 0.5)
    assert optremat.resolve_budget(graph, "0.5") == optremat.resolve_budget(graph, " 0.5 ") == half
    assert optremat.resolve_budget(graph, np.float64(0.5)) == optremat.resolve_budget(graph, np.float32(0.5)) == half
    assert optremat.resolve_budget(graph, "1") == optremat.resolve_budget(graph, 1.0)
    assert optremat.resolve_budget(graph, "1000") == optremat.resolve_budget(graph, "1e3") == 1000
    assert optremat.resolve_budget(graph, np.int64(10**9)) == optremat.resolve_budget(graph, "1GB") == 10**9
    assert optremat.resolve_budget(graph, "1.5KiB") == 1536
    for bad, says in (("1.5", "neither a fraction in .0, 1. nor a whole number of bytes"),
                      ("2.5", "neither a fraction"), ("1.5b", "not a whole number of bytes"), ("0", "is zero"),
                      ("0.0001kb", "under one byte"), ("-1", "not understood"), ("nan", "not understood"),
                      ("7 parsecs", "not understood"), (True, "not understood"), (np.True_, "not understood"),
                      (1.5, "a float is a fraction"), (float("inf"), "a float is a fraction"),
                      (np.float64("nan"), "a float is a fraction"), (0, "bytes must be > 0"),
                      (None, "NoneType"), ([0.5], "list")):
        with pytest.raises(ValueError, match=says) as error:
            optremat.resolve_budget(graph, bad)
        assert "a budget is" in str(error.value)


def tiny() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Six tanh layers: a plan at 90% of their unplanned peak recomputes some of them."""
    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(64, 4)), (torch.randn(256, 64),)


@pytest.mark.parametrize("options, says", [
    ({"budget": "1.5"}, "budget '1.5' is neither"),
    ({"budget": True}, "budget True is not understood"),
    ({"budget": np.float64(1.5)}, "a float is a fraction"),
    ({"time_limit": 0}, "time_limit must be a finite number of seconds > 0, not 0"),
    ({"time_limit": -1.0}, "time_limit must be"),
    ({"time_limit": float("nan")}, "time_limit must be .*nan"),
    ({"time_limit": math.inf}, "time_limit must be .*inf"),
    ({"time_limit": "10"}, "time_limit must be"),
    ({"time_limit": True}, "time_limit must be"),
    ({"workers": -3}, "workers must be a whole number from 0 to 10,000 .*-3"),
    ({"workers": 100_000}, "workers must be a whole number from 0"),
    ({"seed": 2**31}, "seed must be a whole number from -2,147,483,648 to 2,147,483,647, not 2147483648"),
    ({"seed": 0.5}, "seed must be"),
    ({"workers": 1.5}, "workers must be"),
    ({"workers": None}, "workers must be"),
    ({"progress": True}, "progress must be None or a function, not True"),
    ({"loss_fn": "cross_entropy"}, "loss_fn must be None or a function"),
    ({"model": lambda x: x}, "plan needs the model as a torch.nn.Module, not function"),
])
def test_plan_refuses_bad_options_before_tracing(monkeypatch, options, says) -> None:
    """A value of the wrong kind raises ValueError, an option that must be a function
    TypeError, both before anything is traced."""
    def traced(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a bad request must be refused before tracing")

    monkeypatch.setattr(planning, "trace", traced)
    model, inputs = tiny()
    error = TypeError if {"progress", "loss_fn", "model"} & set(options) else ValueError
    with pytest.raises(error, match=says):
        optremat.plan(**{"model": model, "example_inputs": inputs, "budget": 0.9, **options})


def test_numpy_budget_time_limit_and_workers_plan_like_python_numbers() -> None:
    model, inputs = tiny()
    plain = optremat.plan(model, inputs, 0.9, time_limit=2.0, workers=1, deterministic=True)
    numpy = optremat.plan(model, inputs, np.float64(0.9), time_limit=np.float64(2.0), workers=np.int64(1),
                          deterministic=True)
    assert numpy.budget_bytes == plain.budget_bytes
    assert numpy.predicted_peak_bytes == plain.predicted_peak_bytes <= plain.budget_bytes
    assert numpy.regions == plain.regions and plain.predicted_overhead > 0
