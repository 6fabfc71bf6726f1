"""The small models the course trains: a CNN for the 8x8 digits images (and
:func:`max_abs_diff`, to compare two runs' weights).

Taught in ``notebooks/03_multicore_training.ipynb``; reused by notebooks 04-06 and the
benchmarks so every comparison runs the same maths. Plain ``torch.nn``: nothing here is
TPU-specific, which is the point.
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers (about 40k parameters).

    Input ``[B, 1, 8, 8]`` float32, output ``[B, num_classes]`` logits. Dropout is there
    on purpose: it makes RNG state part of what a checkpoint must restore.
    """

    def __init__(self, num_classes: int = 10, width: int = 16, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(2 * width * 4 * 4, 64), nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
