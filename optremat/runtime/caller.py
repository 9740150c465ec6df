"""Warnings a planned model raises as it runs, pointed at the user's own line.

A warning raised inside a planned forward is many frames below the line that called the
model (torch's module call, optremat's wrapper, the plan's choice of regions), and how
many depends on the path taken; a fixed `stacklevel` pointed at torch's or contextlib's
code. `warn` points at the first frame outside optremat, torch and the standard
library's context managers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import torch

import optremat

_INSIDE = (*(os.path.dirname(package.__file__) + os.sep for package in (optremat, torch)),
           contextlib.__file__, functools.__file__)


def warn(message: str) -> None:
    """`warnings.warn(message)` attributed to the user's line that led to it."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
