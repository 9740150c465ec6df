"""The torch-free core: the graph IR of a training step, the one liveness engine that prices
every plan, budgets, and the rewrites of a graph (coarsening, op order, data-parallel shards)."""
