"""Module structures the tests plan, written the ways people write them."""

from __future__ import annotations

import torch
import torch.nn as nn


class Twice(nn.Module):
    """Calls one block twice in its forward, on its own output: the first result is held
    through the second call."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))
