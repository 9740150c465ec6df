import optremat
from benchmarks.distributed import llama
from optremat import FSDP, Region
model, inputs, loss_fn = llama("llama-1b")
par = FSDP(units=("model.layers.*",), world=8, optimizer_state=4.0)
layers = [Region(f"model.layers.{i}", 0) for i in range(16)]
pb = optremat.price_regions(model, inputs, layers, loss_fn=loss_fn, parallel=par, device="h100")
p = optremat.plan(model, inputs, pb.predicted_peak_bytes, loss_fn=loss_fn, parallel=par, device="h100", time_limit=20)
print(pb.predicted_peak_bytes/2**30, pb.predicted_overhead, p.predicted_peak_bytes/2**30, p.predicted_overhead, p.solver)
