import time, optremat, numpy as np
from benchmarks.distributed import llama
from optremat import FSDP, Region
from optremat.extract import trace
from optremat.plan import _region_map
from optremat.regions import search
model, inputs, loss_fn = llama("llama-1b")
par = FSDP(units=("model.layers.*",), world=8, optimizer_state=4.0)
tr = trace(model, inputs, loss_fn, device="h100")
rmap = _region_map(tr, model, "h100", par)
for st in rmap.structures(): print(len(st), st[:3])
t=time.time()
cands = search(rmap, int(9.92*2**30), None)
print(time.time()-t)
for c in cands: print(c.source, round(c.result.peak_bytes/2**30,2), round(c.overhead,3), len(c.lowering.regions))
