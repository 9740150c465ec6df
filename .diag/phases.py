import time, torch
t0=time.time()
import optremat
from optremat.models import build
from optremat.sharding import FSDP
from optremat.distributed.trial import gradients_of
ex = build("gpt-mini", batch=2)
t1=time.time()
p = optremat.plan(ex.model, ex.inputs, 0.75, loss_fn=ex.loss_fn, parallel=FSDP(units=("blocks.*",), world=2), time_limit=10, deterministic=True)
t2=time.time()
p = optremat.plan(ex.model, ex.inputs, 0.75, loss_fn=ex.loss_fn, parallel=FSDP(units=("blocks.*",), world=2), time_limit=2, deterministic=True)
t3=time.time()
g = gradients_of("gpt-mini", 4)
t4=time.time()
print(f"import+build {t1-t0:.1f} plan10 {t2-t1:.1f} plan2 {t3-t2:.1f} grads {t4-t3:.1f}")
