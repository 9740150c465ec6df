"""From a model to a graph: tracing a training step on fake tensors, the inputs it takes,
the cost of each op, and the name of the model a plan is for."""
