"""Line plots for reports (the `bench` command and the benchmark suite)."""

from __future__ import annotations

from pathlib import Path


def plot_lines(path: Path, lines: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str, *,
               invert_x: bool = False, log: bool = False, marks: dict[str, list[tuple[float, float]]] | None = None
               ) -> None:
    """One line per entry of `lines` (and unconnected markers per entry of `marks`), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, points in lines.items():
        if points:
            x, y = zip(*sorted(points))
            axes.plot(x, y, marker="o", markersize=3, label=label)
    for label, points in (marks or {}).items():
        if points:
            x, y = zip(*points)
            axes.scatter(x, y, marker="x", s=40, label=label, zorder=3)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    if log:
        axes.set_xscale("log")
        axes.set_yscale("log")
    if invert_x:
        axes.invert_xaxis()
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
