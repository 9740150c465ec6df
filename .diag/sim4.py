import time, optremat, numpy as np
from benchmarks.distributed import llama
from optremat import FSDP, Region
from optremat.extract import trace
from optremat.plan import _region_map
from optremat.regions import price
model, inputs, loss_fn = llama("llama-1b")
par = FSDP(units=("model.layers.*",), world=8, optimizer_state=4.0)
tr = trace(model, inputs, loss_fn, device="h100")
rmap = _region_map(tr, model, "h100", par)
st = rmap.structures()[1]
t=time.time()
for call in st[:4] + st[-2:]:
    kept = np.ones(rmap.graph.n, bool); kept[rmap.members[call]] = False
    p = price(rmap, (call,), kept, "x")
    print(call, round(p.overhead,4), round(p.result.peak_bytes/2**30,3), len(p.lowering.regions))
print((time.time()-t)/6)
