import time, cProfile, pstats
import optremat
from optremat.models import build
from optremat.sharding import FSDP
ex = build("gpt-mini", batch=2)
t=time.time()
cProfile.run('optremat.plan(ex.model, ex.inputs, 0.75, loss_fn=ex.loss_fn, parallel=FSDP(units=("blocks.*",), world=2), time_limit=1)', '/tmp/prof')
print(time.time()-t)
pstats.Stats('/tmp/prof').sort_stats('cumulative').print_stats(18)
