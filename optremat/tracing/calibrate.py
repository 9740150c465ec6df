"""A device profile measured on the device itself, for a GPU (or host) no built-in profile
describes, or to price a step as this machine's PyTorch runs it.

Each rate is timed on small, fixed workloads in about a second: matrix products in a
16-bit type and in float32, a copy (on a CPU also one its cache holds), chains of tiny
ops, plain and checkpointed (with and without a selective policy).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from optremat.tracing.costs import DEVICES, DeviceProfile

_CHAIN = 64
"""Tiny ops per timed chain: enough that a chain's own fixed cost is noise."""
_RERUN_LENGTHS = (1, 9)
"""Ops per checkpointed call, two lengths: the fixed cost per call and the cost per saved
tensor are the line through the two."""


def measure_profile(device: str | torch.device | None = None, name: str | None = None) -> DeviceProfile:
    """A `DeviceProfile` of `device` measured on it: the product rates in bfloat16 (or
    float16 where bfloat16 has no fast kernel) and float32 as PyTorch runs them now (its
    TF32 settings included), the copy bandwidth (on a CPU also of a copy its cache holds,
    8 MiB), the time one tiny op takes (on a GPU the host's launch: the GPU works on one
    op while the host launches the next), what a Python dispatch mode adds per op, and
    what `torch.utils.checkpoint` adds per call and per saved tensor. Pass it as
    `device=` to `plan`, `compile_backend` or `extract`; `name` names it (the device's
    name by default). What no workload shows (the host allocator's mapped pages, the size
    the CPU's cache rate holds to, the RNG state's bytes) is the CPU's or the GPUs'
    built-in. `device` is a CUDA device or the CPU (None: the current CUDA device where
    there is one, else the CPU); anything else is a ValueError."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"measure_profile: {device!r} is no device ({error})") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"measure_profile times a CUDA device or the CPU, not {str(device)!r}"
                         + (" (no CUDA device here)" if device.type == "cuda" else ""))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    base = DEVICES["h100" if cuda else "cpu"]
    side = 4096 if cuda else 512
    half = torch.bfloat16 if not cuda or torch.cuda.is_bf16_supported() else torch.float16
    launch = _per_op(device)
    rerun, pack, dispatch = _checkpoint_costs(device, launch)
    return dataclasses.replace(
        base,
        name=name or (torch.cuda.get_device_name(device) if cuda else "cpu (measured)"),
        flops_per_second=_product_rate(device, half, side),
        float32_flops_per_second=_product_rate(device, torch.float32, side),
        bytes_per_second=_copy_rate(device, (256 if cuda else 128) * 2**20),
        cache_bytes_per_second=None if cuda else _copy_rate(device, 8 * 2**20),
        launch_seconds=launch, dispatch_seconds=dispatch, rerun_seconds=rerun, pack_seconds=pack,
        overlaps_launch=cuda)


def _best_seconds(device: torch.device, run: Callable[[], object], repeats: int = 5) -> float:
    """The least wall time of `run` over `repeats` tries, after one untimed, with the
    device's queue drained before and after each."""
    run()
    best = float("inf")
    for _ in range(repeats):
        _drain(device)
        start = time.perf_counter()
        run()
        _drain(device)
        best = min(best, time.perf_counter() - start)
    return best


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _product_rate(device: torch.device, dtype: torch.dtype, side: int) -> float:
    a, b = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    times = 8
    seconds = _best_seconds(device, lambda: [torch.mm(a, b, out=out) for _ in range(times)])
    return times * 2 * side**3 / seconds


def _copy_rate(device: torch.device, nbytes: int) -> float:
    source = torch.empty(nbytes // 4, device=device).uniform_()
    target = torch.empty_like(source)
    times = 8
    seconds = _best_seconds(device, lambda: [target.copy_(source) for _ in range(times)])
    return times * 2 * nbytes / seconds


def _per_op(device: torch.device) -> float:
    """Seconds per op of a chain of `_CHAIN` tiny ops."""
    x = torch.ones(8, device=device)

    def chain() -> None:
        y = x
        for _ in range(_CHAIN):
            y = y + 1

    return _best_seconds(device, chain, repeats=9) / _CHAIN


def _checkpoint_costs(device: torch.device, launch: float) -> tuple[float, float, float]:
    """What checkpoint adds to a forward and backward: per call (its bookkeeping and the
    RNG state it stashes and restores), per tensor the call's ops save beyond the rerun's
    own ops (`launch` each), and per op a selective policy looks at (in the forward and
    again in the rerun)."""
    x = torch.ones(8, device=device, requires_grad=True)

    def sines(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def call(y: torch.Tensor) -> torch.Tensor:
            for _ in range(n):
                y = torch.sin(y)
            return y
        return call

    def step(n: int, options: dict | None) -> float:
        call = sines(n)

        def run() -> None:
            for _ in range(_CHAIN // n):
                y = call(x) if options is None else checkpoint(call, x, use_reentrant=False, **options)
                y.sum().backward()
        return _best_seconds(device, run, repeats=9) / (_CHAIN // n)

    plain = {n: step(n, None) for n in _RERUN_LENGTHS}
    added = [step(n, {}) - plain[n] for n in _RERUN_LENGTHS]
    (short, long), (few, many) = _RERUN_LENGTHS, added
    per_op = max((many - few) / (long - short), launch)
    policy = functools.partial(create_selective_checkpoint_contexts, _recompute)
    looked = step(long, {"context_fn": policy}) - plain[long] - many
    return max(few - short * per_op, 0.0), per_op - launch, max(looked / (2 * long), 0.0)


def _recompute(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE
