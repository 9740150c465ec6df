import json
import subprocess
import sys
from pathlib import Path

GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optremat.cli", *args], capture_output=True, text=True, timeout=300)


def test_graph_of_a_builtin_model_as_json():
    result = run("graph", "--model", "gpt-tiny", "--json")
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
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_published_graph():
    path = GRAPHS / "vgg16_b256_224x224_train.json"
    if not path.exists():
        import pytest
        pytest.skip(f"published graphs not found at {GRAPHS}")
    data = json.loads(run("graph", "--graph", str(path), "--json").stdout)
    assert data["nodes"] == 45
