import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"


from optremat.models import load
from tests.console import run
from tests.test_cache import read_only  # noqa: F401 - a fixture


def test_graph_of_a_builtin_model_as_json():
    """Through `python -m optremat.cli`, as installed (the other tests call its main)."""
    result = subprocess.run([sys.executable, "-m", "optremat.cli", "graph", "--model", "gpt-tiny", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["nodes"] > data["coarse_nodes"] > 0
    assert data["unplanned_peak_bytes"] > data["resident_bytes"] > 0


def test_graph_text_summary_and_save(tmp_path):
    result = run("graph", "--model", "mlp-tiny", "--save", str(tmp_path / "g.json"))
    assert result.returncode == 0, result.stderr
    assert "unplanned peak" in result.stdout and "coarsened" in result.stdout
    again = run("graph", "--graph", str(tmp_path / "g.json"), "--json")
    assert json.loads(again.stdout)["nodes"] == json.loads(run("graph", "--model", "mlp-tiny", "--json").stdout)["nodes"]


def test_bad_inputs_exit_2_with_one_line():
    missing = run("graph", "--graph", "/does/not/exist.json")
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "exist.json" in missing.stderr
    unknown = run("graph", "--model", "no-such-model")
    assert unknown.returncode == 2 and "unknown model 'no-such-model'" in unknown.stderr
    assert unknown.stderr.strip().count("\n") == 0


def test_a_malformed_graph_file_exits_2_with_one_line(tmp_path):
    assert run("graph", "--model", "mlp-tiny", "--save", str(tmp_path / "g.json")).returncode == 0
    saved = json.loads((tmp_path / "g.json").read_text())
    for name, content in (("list", []), ("null", None), ("ints", {"nodes": [1], "links": []}),
                          ("sizes", {**saved, "size": None}), ("cost", {**saved, "cost": 5}),
                          ("huge", {**saved, "held": [10**30] * len(saved["held"])})):
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
        result = run("graph", "--graph", str(tmp_path / f"{name}.json"))
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, (name, result.stderr)
        assert "graph" in result.stderr, (name, result.stderr)


def test_a_node_link_graph_file(tmp_path):
    from tests.test_graph import checkmate_flavour

    (tmp_path / "g.json").write_text(json.dumps(checkmate_flavour()))
    result = run("graph", "--graph", str(tmp_path / "g.json"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["nodes"] == 4


def test_published_graph():
    path = GRAPHS / "vgg16_b256_224x224_train.json"
    if not path.exists():
        import pytest
        pytest.skip(f"published graphs not found at {GRAPHS}")
    data = json.loads(run("graph", "--graph", str(path), "--json").stdout)
    assert data["nodes"] == 45


def test_plan_a_graph_file_within_budget(tmp_path):
    from optremat import Schedule, simulate
    from tests.dags import training_chain

    chain = training_chain([1.0] * 12, [8] * 12)
    chain.save(tmp_path / "chain.json")
    result = run("plan", "--graph", str(tmp_path / "chain.json"), "--budget", "0.6", "--time-limit", "10",
                 "--save", str(tmp_path / "s.json"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["peak_bytes"] <= report["budget_bytes"] < report["unplanned_peak_bytes"]
    assert report["status"] == "OPTIMAL" and report["overhead"] > 0
    schedule = Schedule.from_json(json.loads((tmp_path / "s.json").read_text()))
    assert simulate(chain, schedule).peak_bytes == report["peak_bytes"]


def test_plan_a_graph_file_with_shares(tmp_path):
    """On this graph no plan fits 90% without sharing (greedy keeps everything and still
    peaks over); with `--share` ops write over inputs they read last, and keeping
    everything fits. CP-SAT's choice of shares is tested against brute force elsewhere."""
    from optremat import Graph, Schedule, simulate

    assert run("graph", "--model", "rnn-tiny", "--save", str(tmp_path / "g.json")).returncode == 0
    graph = Graph.load(tmp_path / "g.json")
    common = ("plan", "--graph", str(tmp_path / "g.json"), "--budget", "0.9", "--solver", "greedy", "--json")
    plain = run(*common)
    assert plain.returncode == 3 and "infeasible for greedy; smallest budget it reaches" in plain.stderr
    result = run(*common, "--share", "--save", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr
    shared = json.loads(result.stdout)
    assert shared["shared"] > 0 and shared["overhead"] == 0.0
    saved = json.loads((tmp_path / "s.json").read_text())
    replayed = simulate(graph, Schedule.from_json(saved), share=frozenset(k for k, _ in saved["shared"]))
    assert replayed.peak_bytes == shared["peak_bytes"] <= shared["budget_bytes"] < shared["unplanned_peak_bytes"]
    refused = run("plan", "--model", "mlp-tiny", "--budget", "0.9", "--share")
    assert refused.returncode == 2 and "--share is for --graph files" in refused.stderr


def test_plan_exit_codes_for_bad_and_infeasible_budgets(tmp_path):
    from tests.dags import training_chain

    training_chain([1.0] * 6, [8] * 6).save(tmp_path / "chain.json")
    for bad in ("0", "-3", "1.5", "nan", "7parsecs"):
        result = run("plan", "--graph", str(tmp_path / "chain.json"), "--budget", bad)
        assert result.returncode == 2, (bad, result.stderr)
        assert result.stderr.strip().count("\n") == 0 and "a budget is" in result.stderr
    infeasible = run("plan", "--graph", str(tmp_path / "chain.json"), "--budget", "0.1")
    assert infeasible.returncode == 3
    assert "smallest feasible budget" in infeasible.stderr and infeasible.stderr.strip().count("\n") == 0


def test_plan_a_builtin_model_then_show_it(tmp_path):
    plan_file, plot = tmp_path / "plan.json", tmp_path / "memory.png"
    result = run("plan", "--model", "resnet-tiny", "--budget", "0.9", "--time-limit", "10", "--json",
                 "--save", str(plan_file))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["peak_bytes"] <= report["budget_bytes"] < report["unplanned_peak_bytes"]
    assert report["regions"] > 0
    shown = run("show", str(plan_file), "--plot", str(plot), "--top", "3")
    assert shown.returncode == 0, shown.stderr
    assert "predicted peak" in shown.stdout and plot.stat().st_size > 0
    assert sum(line.split()[:1] in (["keep"], ["recompute"], ["share"], ["free"]) for line in shown.stdout.splitlines()) == 3
    again = json.loads(run("show", str(plan_file), "--json").stdout)
    assert again["peak_bytes"] == report["peak_bytes"] and again["fingerprint"] == report["fingerprint"]


def test_show_rejects_a_file_that_is_not_a_plan(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "something else"}')
    result = run("show", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "not an optremat plan" in result.stderr


def test_a_negative_top_and_a_cache_dir_that_is_a_file_exit_2_with_one_line(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    for args, message in ((("show", str(tmp_path / "x.json"), "--top", "-3"), "--top must be"),
                          (("cache", "list", "--dir", str(tmp_path / "x.json")), "is a file"),
                          (("cache", "clear", "--dir", str(tmp_path / "x.json")), "is a file")):
        result = run(*args)
        assert result.returncode == 2 and message in result.stderr and result.stderr.strip().count("\n") == 0


def test_plan_model_bad_budgets_exit_2_with_one_line():
    for bad in ("0", "-1", "nan", "2.5", "12 parsecs", "1000"):
        result = run("plan", "--model", "mlp-tiny", "--budget", bad)
        assert result.returncode == 2, (bad, result.stderr)
        assert result.stderr.strip().count("\n") == 0 and "a budget is" in result.stderr, (bad, result.stderr)
    below = run("plan", "--model", "mlp-tiny", "--budget", "1000")
    assert "parameters, inputs and gradients" in below.stderr


def test_plan_model_infeasible_budget_exits_3_naming_the_smallest():
    result = run("plan", "--model", "resnet-tiny", "--budget", "0.3", "--time-limit", "5")
    assert result.returncode == 3, result.stderr
    assert "smallest feasible budget" in result.stderr and result.stderr.strip().count("\n") == 0


@pytest.mark.skipif(not Path(sys.executable).with_name("optremat").exists(),
                    reason="the optremat console script is not installed beside this Python")
def test_a_model_file_imports_from_where_the_command_runs(tmp_path):
    """The installed `optremat` command, run from a project's root on a model file in a
    subfolder that imports the project's own package, as `benchmarks/scale.py` does."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "__init__.py").write_text(
        "import torch\n"
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())\n"
        "                                 for _ in range(4)])\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "build.py").write_text(
        "import torch\nfrom project import mlp\ndef build():\n    return mlp(), torch.randn(64, 32)\n")
    command = Path(sys.executable).with_name("optremat")
    result = subprocess.run([str(command), "plan", "--model", "models/build.py:build", "--budget", "1.0",
                             "--time-limit", "2", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0 < data["peak_bytes"] <= data["budget_bytes"]


def test_plan_a_model_from_a_python_file(tmp_path):
    source = tmp_path / "mymodel.py"
    source.write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())\n"
        "                                  for _ in range(6)])\n"
        "    return model, torch.randn(256, 64)\n")
    result = run("plan", "--model", f"{source}:build", "--budget", "0.9", "--time-limit", "5", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["peak_bytes"] <= data["budget_bytes"] < data["unplanned_peak_bytes"]
    missing = run("plan", "--model", f"{source}:nothing", "--budget", "0.8")
    assert missing.returncode == 2 and "defines no function 'nothing'" in missing.stderr


def test_plan_one_rank_of_a_data_parallel_job(tmp_path):
    plan_file = tmp_path / "plan.json"
    result = run("plan", "--model", "gpt-tiny", "--budget", "0.9", "--time-limit", "2", "--fsdp", "blocks.*",
                 "--world", "8", "--optimizer-state", "2", "--save", str(plan_file))
    assert result.returncode == 0, result.stderr
    assert "per rank: FSDP2 over 8 ranks, units blocks.*" in result.stdout
    shown = run("show", str(plan_file))
    assert "per rank: FSDP2 over 8 ranks" in shown.stdout
    for bad, says in ((["--world", "8"], "--world needs"), (["--ddp"], "need --world"),
                      (["--ddp", "--fsdp", "blocks.*", "--world", "2"], "one of --fsdp and --ddp"),
                      (["--optimizer-state", "2"], "--optimizer-state is what each rank")):
        refused = run("plan", "--model", "gpt-tiny", "--budget", "0.9", *bad)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr


def one_line_error(result) -> str:
    """The error of a command refused as bad input: exit status 2, one line on stderr."""
    assert result.returncode == 2, result
    assert result.stderr.startswith("optremat: error: ") and result.stderr.strip().count("\n") == 0, result.stderr
    return result.stderr


def test_plan_refuses_bad_options_with_one_line_before_loading_the_model(tmp_path, monkeypatch):
    import optremat.models

    def load(*args):
        raise AssertionError("bad options must be refused before the model is loaded")

    monkeypatch.setattr(optremat.models, "load", load)
    plan = ("plan", "--budget", "0.9")
    for args, says in ((("--model", ""), "--model is empty"), (("--graph", " "), "--graph is empty"),
                       (("--model", "mlp-tiny", "--workers", "-3"), "--workers must be a whole number from 0"),
                       (("--model", "mlp-tiny", "--workers", "100000"), "--workers must be a whole number from 0"),
                       (("--model", "mlp-tiny", "--seed", str(2**31)), "--seed must be a whole number from"),
                       (("--model", "mlp-tiny", "--time-limit", "0"), "--time-limit must be a number of seconds > 0"),
                       (("--model", "mlp-tiny", "--time-limit", "nan"), "--time-limit must be"),
                       (("--model", "mlp-tiny", "--save", str(tmp_path / "no" / "plan.json")),
                        f"directory {tmp_path / 'no'} does not exist"),
                       (("--model", "mlp-tiny", "--save", str(tmp_path)), "is a directory")):
        assert says in one_line_error(run(*plan, *args)), args
    assert "budget '1.5' is neither" in one_line_error(run("plan", "--model", "mlp-tiny", "--budget", "1.5"))
    assert "--runs must be at least 1" in one_line_error(run("bench", "--model", "mlp-tiny", "--runs", "0"))
    assert "unknown --device 'tpu'" in one_line_error(run(*plan, "--model", "mlp-tiny", "--device", "tpu"))
    assert list(tmp_path.iterdir()) == []


def test_plan_prices_ops_over_rates_measured_on_this_machine():
    result = run("plan", "--model", "resnet-tiny", "--budget", "0.9", "--device", "measured", "--time-limit", "5",
                 "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["peak_bytes"] <= report["budget_bytes"] and report["overhead"] > 0


def test_show_refuses_what_is_not_a_saved_plan_with_one_line(tmp_path):
    plan_file = tmp_path / "plan.json"
    made = run("plan", "--model", "resnet-tiny", "--budget", "0.9", "--time-limit", "2", "--deterministic",
               "--save", str(plan_file), "--json")
    assert made.returncode == 0, made.stderr
    data = json.loads(plan_file.read_text())
    data["regions"][0][1] += 1
    (tmp_path / "edited.json").write_text(json.dumps(data))
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "future.json").write_text(json.dumps({**data, "format": 999}))
    for name, says in (("edited.json", "was changed after it was saved"), ("list.json", "one JSON object, not a list"),
                       ("broken.json", "is not valid JSON"), ("missing.json", "No such file"),
                       ("future.json", "format tag 999, not 'optremat.plan'")):
        error = one_line_error(run("show", str(tmp_path / name)))
        assert says in error and name in error, error


def test_a_plan_that_cannot_be_saved_is_printed_then_the_error(tmp_path, read_only):
    target = tmp_path / "plans"
    target.mkdir()
    read_only(target)
    result = run("plan", "--model", "resnet-tiny", "--budget", "0.9", "--time-limit", "2", "--deterministic",
                 "--save", str(target / "plan.json"))
    assert "predicted peak" in result.stdout and "plan written" not in result.stdout
    assert f"cannot write {target / 'plan.json'}: Permission denied" in one_line_error(result)
    assert list(target.iterdir()) == []


MODEL_FILE = '''
import torch, torch.nn as nn


class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                                      for _ in range(4)])

    def forward(self, x, target):
        out = self.blocks(x)
        return {"loss": nn.functional.mse_loss(out, target), "out": out}


def model():
    torch.manual_seed(0)
    return OwnLoss(), {"x": torch.randn(256, 32), "target": torch.randn(256, 32)}
'''


def test_a_model_file_giving_a_dict_batch_is_called_with_keywords_and_its_own_loss(tmp_path):
    (tmp_path / "own.py").write_text(MODEL_FILE)
    result = run("plan", "--model", f"{tmp_path / 'own.py'}:model", "--budget", "0.7", "--time-limit", "10",
                 "--deterministic")
    assert result.returncode == 0, result.stderr
    assert "predicted peak" in result.stdout
    example = load(f"{tmp_path / 'own.py'}:model")
    output = example.model(**example.inputs)
    assert torch.equal(example.loss_fn(output), output["loss"])


def test_a_model_file_or_function_that_fails_is_one_line_naming_it(tmp_path):
    """A model file that does not run, a function that needs arguments or raises: one line
    naming the file, the function and the exception, exit 2; through the library, a
    ValueError whose cause is the exception."""
    (tmp_path / "syntax.py").write_text("this is not python(\n")
    (tmp_path / "fails.py").write_text("import torch\n\ndef needs_args(n):\n    return n\n\n"
                                       "def raises():\n    raise RuntimeError('boom\\n  on two lines')\n\n"
                                       "def bad_loss():\n    return torch.nn.Linear(2, 2), torch.ones(2), 'mse'\n")
    for spec, says in ((f"{tmp_path / 'syntax.py'}:build", f"model file {tmp_path / 'syntax.py'} could not be loaded: "
                        "SyntaxError: "),
                       (f"{tmp_path / 'fails.py'}:needs_args", f"needs_args() in model file {tmp_path / 'fails.py'} "
                        "failed: TypeError: needs_args() missing 1 required positional argument: 'n'"),
                       (f"{tmp_path / 'fails.py'}:raises", "raises() in model file "
                        f"{tmp_path / 'fails.py'} failed: RuntimeError: boom on two lines"),
                       (f"{tmp_path / 'fails.py'}:bad_loss", "returned a loss_fn that is not a function: 'mse'")):
        for command in (("plan", "--budget", "0.9"), ("graph",)):
            assert says in one_line_error(run(*command, "--model", spec)), (spec, command)
    with pytest.raises(ValueError, match="raises.. in model file") as error:
        load(f"{tmp_path / 'fails.py'}:raises")
    assert isinstance(error.value.__cause__, RuntimeError)


def test_max_batch_refuses_a_negative_overhead_cap_and_says_when_not_even_batch_1_fits(monkeypatch):
    """A negative --max-overhead is bad input, refused before tracing; a memory no batch
    fits, even planned, is infeasible (exit 3) naming what batch 1 needs; one only a
    planned batch 1 fits has no unplanned-to-planned ratio."""
    import optremat.planning.batch

    traced = optremat.planning.batch.batch_ways

    def not_traced(*args):
        raise AssertionError("a bad option must be refused before the model is traced")

    monkeypatch.setattr(optremat.planning.batch, "batch_ways", not_traced)
    for cap in ("-1", "nan"):
        error = one_line_error(run("max-batch", "--model", "mlp-tiny", "--memory", "1MiB", "--max-overhead", cap))
        assert "--max-overhead must be a fraction of extra compute >= 0" in error, cap
    monkeypatch.setattr(optremat.planning.batch, "batch_ways", traced)
    nothing = run("max-batch", "--model", "mlp-tiny", "--memory", "1KiB", "--time-limit", "0.02", "--deterministic")
    assert nothing.returncode == 3 and nothing.stdout == "" and nothing.stderr.strip().count("\n") == 0
    assert nothing.stderr.startswith("optremat: infeasible: mlp-tiny does not fit in 1.00 KiB even at batch 1: its "
                                     "step needs ") and "no plan goes below" in nothing.stderr, nothing.stderr
    planned_only = run("max-batch", "--model", "resnet-tiny", "--memory", "3300000", "--time-limit", "0.02",
                       "--deterministic", "--json")
    assert planned_only.returncode == 0, planned_only.stderr
    report = json.loads(planned_only.stdout)
    assert report["unplanned_batch"] == 0 and report["planned_batch"] >= 1 and report["ratio"] is None
    capped = run("max-batch", "--model", "mlp-tiny", "--memory", "100TiB", "--time-limit", "0.02", "--deterministic")
    assert capped.returncode == 0 and "the search stops at batch 1048576" in capped.stdout, capped.stdout
