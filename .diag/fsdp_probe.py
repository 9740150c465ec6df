import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from optremat.models import build
from optremat.runtime.measure import measure_peak, resident_bytes

def run(rank, world, mode):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ex = build("gpt-mini", batch=2)
    model = ex.model
    if mode == "fsdp":
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    inputs = ex.inputs
    def step():
        loss = ex.loss_fn(model(*inputs))
        loss.backward()
    step()
    for p in model.parameters(): p.grad = None
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    grads = []
    m = measure_peak(step, resident=[params, inputs])
    print(rank, mode, "resident", m.resident_bytes/2**20, "peak", m.peak_bytes/2**20, flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mode = sys.argv[1]
    mp.spawn(run, args=(2, mode), nprocs=2)
