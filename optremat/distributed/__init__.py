"""Plans for data-parallel training on torch.distributed.

`plan` makes one plan for every rank of a process group (planned on rank 0, checked and
broadcast, so every rank runs the same regions and no collective waits on a rank that
decided otherwise); `wrap` applies FSDP2 or DDP the way the plan was priced;
`held_by_rank` lists what a rank keeps between steps (to measure a step's peak on top
of); `run_local` starts a job on this machine's CPUs (gloo), as tests and benchmarks do.
"""

from optremat.distributed.agree import plan
from optremat.distributed.local import run_local
from optremat.distributed.wrap import held_by_rank, wrap

__all__ = ["held_by_rank", "plan", "run_local", "wrap"]
