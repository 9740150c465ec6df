"""What a plan is made for: a model's structure, whatever its inputs' shapes."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from pathlib import Path

import torch.nn as nn


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's structure (module types, parameter and buffer names, shapes and
    dtypes): a plan applies to a model with the same fingerprint."""
    digest = hashlib.sha256()
    for path, module in model.named_modules():
        digest.update(f"{path}:{type(module).__qualname__}\x1f".encode())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tensor.dtype}{list(tensor.shape)}\x1f".encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def package_version() -> str:
    """optremat's installed version and a hash of its sources, part of every plan cache
    key: a changed planner never reuses plans (or compiled graphs) another one made."""
    try:
        version = importlib.metadata.version("optremat")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return f"{version}+{digest.hexdigest()[:16]}"
