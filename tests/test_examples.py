"""The examples run as their users run them, in their short versions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    """An example script imported as a module (its `main` not run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_trainer_example_trains_as_unplanned_within_each_buckets_budget_planning_each_once() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = example("trainer_causal_lm")
    report = script.run(steps=4, smoke=True, time_limit=0.5)
    assert not report.failures(), str(report)
    assert len(report.buckets) >= 2, "the smoke run steps on two lengths or more"
