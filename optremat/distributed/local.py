"""Run a function on several local processes joined in a gloo process group."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""How long a rank waits in one collective before failing: a local job whose ranks stop
meeting (gloo was seen to stall once in an FSDP2 gather under load) fails with an error
instead of hanging."""


def run_local(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """`fn(*args)` on `world` new processes in one process group, each with its share of
    the CPU cores for its threads (as torchrun sets OMP_NUM_THREADS); their results in
    rank order. Every rank waits for the others before leaving the group, so no rank tears
    down gloo while another's collectives are in flight. `fn` must be importable (a
    module-level function); an exception on any rank fails the run with its traceback."""
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_rank, args=(world, _free_port(), backend, directory, fn, args), nprocs=world, join=True)
        return [pickle.loads((Path(directory) / f"{rank}.pickle").read_bytes()) for rank in range(world)]


def _rank(rank: int, world: int, port: int, backend: str, directory: str, fn: Callable[..., Any],
          args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(*args)
        (Path(directory) / f"{rank}.pickle").write_bytes(pickle.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank has its result and passed the barrier. Leave without the interpreter's
    # teardown: there a native thread still joinable at destruction aborted a rank with
    # "terminate called without an active exception" in 1 of 10 test runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
