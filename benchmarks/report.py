"""What every benchmark section shares: markdown tables and the machine line."""

from __future__ import annotations

import os
import platform

import ortools
import torch


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def machine() -> str:
    """CPU, cores, library versions: the line every results section states."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}, "
            f"ortools {ortools.__version__}, Python {platform.python_version()}")
