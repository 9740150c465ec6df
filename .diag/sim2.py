import time, optremat, numpy as np
from benchmarks.distributed import llama
from optremat import FSDP, Region
model, inputs, loss_fn = llama("llama-1b")
par = FSDP(units=("model.layers.*",), world=8, optimizer_state=4.0)
for k in (16, 12, 8, 0):
    layers = [Region(f"model.layers.{i}", 0) for i in range(k)]
    pb = optremat.price_regions(model, inputs, layers, loss_fn=loss_fn, parallel=par, device="h100")
    g = pb.graph
    res = optremat.simulate(g, pb.schedule)
    e = int(np.argmax(res.curve)); s = int(pb.schedule.stage[e]); node = int(pb.schedule.node[e])
    print(k, round(pb.predicted_peak_bytes/2**30,2), f"{pb.predicted_overhead:.3f}", "peak at stage", s, g.ops[s], g.module[s], "node", g.ops[node], g.module[node], "held", round(g.held[s]/2**30,2), "bwd", g.backward[s])
