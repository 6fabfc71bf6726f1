"""Notebook 07's table plumbing: the three sharding layouts side by side."""

from __future__ import annotations

import pandas as pd
import torch


def compare_layouts(variants: dict[str, tuple[pd.DataFrame, torch.Tensor, int]],
                    reference: torch.Tensor, warmup: int) -> pd.DataFrame:
    """One row per layout from ``{name: (sharding table, losses, compiles after warm-up)}``:
    parameter bytes, bytes per device, the fraction each device holds, the largest loss
    difference to ``reference`` and the compiles after step ``warmup``."""
    rows = [{"layout": name, "param bytes": table["bytes"].sum(),
             "bytes/device": table["bytes/device"].sum(),
             "fraction": table["bytes/device"].sum() / table["bytes"].sum(),
             "max |loss - reference|": float((losses - reference).abs().max()),
             f"compiles after step {warmup}": late}
            for name, (table, losses, late) in variants.items()]
    return pd.DataFrame(rows).set_index("layout")
