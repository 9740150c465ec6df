import time, optremat
from benchmarks.distributed import llama, LLAMAS
from optremat import FSDP, Region
import sys
name = sys.argv[1]
model, inputs, loss_fn = llama(name)
layers = [Region(f"model.layers.{i}", 0) for i in range(model.config.num_hidden_layers)]
par = FSDP(units=("model.layers.*",), world=8, optimizer_state=4.0)
t=time.time()
pb = optremat.price_regions(model, inputs, layers, loss_fn=loss_fn, parallel=par, device="h100")
print("per-block", pb.predicted_peak_bytes/2**30, pb.baseline_peak_bytes/2**30, pb.predicted_overhead, time.time()-t)
t=time.time()
p = optremat.plan(model, inputs, pb.predicted_peak_bytes, loss_fn=loss_fn, parallel=par, device="h100", time_limit=float(sys.argv[2]))
print("optremat", p.predicted_peak_bytes/2**30, p.predicted_overhead, p.solver, p.status, time.time()-t)
print(p.summary())
