import sys, time, numpy as np
from optremat.distributed.trial import run, gradients_of
from optremat.sharding import FSDP, DDP
if __name__ == "__main__":
    par = FSDP(units=("blocks.*",)) if sys.argv[1] == "fsdp" else DDP()
    budget = float(sys.argv[2])
    t = time.time()
    steps = run("gpt-mini", 2, budget, par, 2, rounds=int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    ref = gradients_of("gpt-mini", 4)
    for s in steps:
        print(s.rank, "budget", s.budget_bytes/2**20, "pred", s.predicted_peak_bytes/2**20, "meas", s.measured_peak_bytes/2**20, f"err {s.measured_peak_bytes/s.predicted_peak_bytes-1:+.3f}", "ovh", s.predicted_overhead, "ratios", np.median(s.ratios) if s.ratios else None)
    print("same decisions", steps[0].decisions == steps[1].decisions)
    g = steps[0].gradients
    print("max grad err", max(float(np.abs(g[k]-ref[k]).max()) for k in ref), all(np.allclose(g[k], ref[k], atol=1e-5, rtol=1e-5) for k in ref))
    print("secs", time.time()-t)
