"""Planners over a graph, torch-free: one entry point over every planner, the module-region
search the native runtime runs, and the largest batch that fits."""
