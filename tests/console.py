"""The `optremat` command run in the test process: its exit status and what it printed."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from optremat.cli import main


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run(*args: str) -> Ran:
    """`optremat ARGS...` as a user types it, without starting another Python (argparse's
    usage errors exit with status 2, as the command does)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return Ran(code, out.getvalue(), err.getvalue())
