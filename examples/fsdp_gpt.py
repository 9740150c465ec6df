"""Train the built-in GPT with FSDP2 (or DDP) under a per-rank memory budget.

    torchrun --nproc-per-node 2 examples/fsdp_gpt.py [--budget 0.8] [--steps 5] [--model gpt-mini] [--ddp]

Every rank builds the same model (same seed) and takes its share of each batch. Rank 0
plans for one rank's share (`optremat.distributed.plan`) and every rank receives the same
plan; the plan is applied before `fully_shard`, as torchtitan orders activation
checkpointing before FSDP, and priced with AdamW's state. On a CPU the ranks talk over
gloo; each reports its measured peak beside the predicted one.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import optremat
import optremat.distributed
from optremat.models import CrossEntropy, build
from optremat.runtime.measure import measure_peak

ADAMW_STATE = 2.0
"""AdamW keeps two moments of each parameter's size."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=2, help="samples per rank")
    parser.add_argument("--budget", default="0.8", help="per-rank budget: bytes, a size such as 90MiB, or a "
                                                        "fraction of one rank's unplanned peak")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ddp", action="store_true", help="DDP instead of FSDP2")
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)

    example = build(args.model, batch=world * args.batch, device=device)
    model = example.model
    inputs = tuple(x.chunk(world)[rank] for x in example.inputs)
    loss_fn = CrossEntropy(example.loss_fn.target.chunk(world)[rank], flatten=True)
    parallel = (optremat.DDP(optimizer_state=ADAMW_STATE) if args.ddp
                else optremat.FSDP(units=("blocks.*",), optimizer_state=ADAMW_STATE))
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    plan = optremat.distributed.plan(model, inputs, budget, parallel, loss_fn=loss_fn, time_limit=10)
    if rank == 0:
        print(plan.summary(), flush=True)
    optremat.apply(model, plan)
    wrapped = optremat.distributed.wrap(model, plan.parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = loss_fn(wrapped(*inputs))
        loss.backward()
        return loss

    for k in range(args.steps):
        if k < 2:
            loss = step()
        else:
            state = [v for s in optimizer.state.values() for v in s.values()]
            held = [optremat.distributed.held_by_rank(model, wrapped, state), inputs]
            box: list[torch.Tensor] = []
            peak = measure_peak(lambda: box.append(step()), resident=held, device=device).peak_bytes
            loss = box[0]
            print(f"rank {rank} step {k}: loss {loss.item():.4f}, peak {peak / 2**20:.1f} MiB measured, "
                  f"{plan.predicted_peak_bytes / 2**20:.1f} MiB predicted, budget {plan.budget_bytes / 2**20:.1f} MiB",
                  flush=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
