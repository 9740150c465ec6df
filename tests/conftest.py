import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("optremat", deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                          database=None)
settings.load_profile("optremat")
"""One profile for every property test: no per-example deadline (solvers and tracing
vary with machine load), the same examples on every run (a run cannot flake on a new
draw), and no health checks on the slow strategies that build graphs."""


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
"""Under pytest-xdist each worker process takes one core: two workers on two cores, not
four threads contending for them."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run the slow tests (realistic-size models, larger exactness checks)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow test: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"))])
def device(request: pytest.FixtureRequest) -> str:
    """Where a test's model runs: the CPU, and the GPU where there is one."""
    return request.param
