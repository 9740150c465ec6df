"""Fast planners (Graph, budget in bytes -> Schedule): plans of their own and seeds for the exact solvers."""

from optremat.heuristics.benefit import greedy_benefit
from optremat.heuristics.chen import chen_greedy, chen_sqrt
from optremat.heuristics.dp import NotAChain, chain_dp
from optremat.heuristics.dtr import dtr
from optremat.heuristics.mirror import mirror
from optremat.heuristics.split import split_lifetimes

__all__ = ["NotAChain", "chain_dp", "chen_greedy", "chen_sqrt", "dtr", "greedy_benefit", "mirror", "split_lifetimes"]
