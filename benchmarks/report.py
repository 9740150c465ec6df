"""What every benchmark section shares: markdown tables and the machine line."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Iterable

import ortools
import torch


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def machine() -> str:
    """CPU, cores, library versions: the line every results section states."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}, "
            f"ortools {ortools.__version__}, Python {platform.python_version()}")


def write_rows(out: Path, head: list[str], header: list[str], batches: Iterable[list[list[str]]]) -> None:
    """Write `head`, then a table of `header` whose rows come in `batches`: each batch is
    printed as it comes and the page rewritten after it, so a long run loses nothing done."""
    lines = head + ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rows in batches:
        for cells in rows:
            lines.append("| " + " | ".join(cells) + " |")
            print(" | ".join(cells), flush=True)
        out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def keep_compiled() -> None:
    """Every configuration keeps its compiled graphs for the timing rounds: a benchmark
    compiling one model under several backends never falls back to eager."""
    import torch

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch._dynamo.config.fail_on_recompile_limit_hit = True
