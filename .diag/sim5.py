import time, optremat, numpy as np
from benchmarks.distributed import llama
from optremat import FSDP
from optremat.extract import trace
from optremat.plan import _region_map
from optremat.regions import _by_yield, _whole
model, inputs, loss_fn = llama("llama-1b")
par = FSDP(units=("model.layers.*",), world=8, optimizer_state=4.0)
tr = trace(model, inputs, loss_fn, device="h100")
rmap = _region_map(tr, model, "h100", par)
st = rmap.structures()[1]
r = _by_yield(rmap, st)
print([c[0] for c in r])
for k in range(len(r)+1):
    p = _whole(rmap, r, k)
    print(k, round(p.result.peak_bytes/2**30,3), round(p.overhead,4), len(p.lowering.regions))
