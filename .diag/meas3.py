import torch, torch.distributed as dist
from optremat.distributed import run_local, wrap, held_by_rank
from optremat.distributed.trial import _slice, _step
from optremat.models import build
from optremat.runtime.measure import measure_peak
from optremat import FSDP
import optremat
def work():
    rank, world = dist.get_rank(), dist.get_world_size()
    ex = _slice(build("gpt-mini", batch=4), rank, world)
    made = optremat.distributed.plan(ex.model, ex.inputs, 0.75, FSDP(units=("blocks.*",)), loss_fn=ex.loss_fn, time_limit=1)
    optremat.apply(ex.model, made)
    w = wrap(ex.model, made.parallel); step = _step(ex)
    step(w); step(w)
    out = []
    for _ in range(5):
        m = measure_peak(lambda: step(w), resident=[held_by_rank(ex.model, w), ex.inputs], setup=lambda: step(w))
        out.append(round(m.peak_bytes/2**20, 2))
    return made.predicted_peak_bytes/2**20, out
if __name__ == "__main__":
    print(run_local(work, 2))
