"""Course-only figures."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tpu_helpers.spmd import _named_tensors, shard_placements


def _as_2d(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, slice, int, int]:
    """The first two dims of a placement (a 1-D tensor is drawn as one row)."""
    if len(shape) == 0:
        return slice(0, 1), slice(0, 1), 1, 1
    if len(shape) == 1:
        return slice(0, 1), index[0], 1, shape[0]
    return index[0], index[1], shape[0], shape[1]


def plot_shard_layout(tensors: Mapping[str, torch.Tensor] | torch.nn.Module,
                      title: str | None = None):
    """A grid: one row per tensor, one column per device. Each cell outlines the whole
    tensor and fills the part that device holds (its colour), with the shard's shape.

    Replicated tensors are filled in every column; a 4-way sharded one shows a quarter
    per device. 1-D tensors are drawn as one row, >2-D ones by their first two dims.
    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    import torch_xla
    import torch_xla.runtime as xr
    from matplotlib.patches import Rectangle

    n = xr.global_runtime_device_count()
    named = _named_tensors(tensors)
    if not named:
        raise ValueError("plot_shard_layout: no tensors to draw")
    fig, axes = plt.subplots(len(named), n, figsize=(1.9 * n + 1.6, 0.95 * len(named) + 0.8),
                             squeeze=False)
    colours = plt.get_cmap("tab10")
    for row, (name, t) in enumerate(named):
        spec = torch_xla._XLAC._get_xla_sharding_spec(t) if t.device.type == "xla" else ""
        shape = tuple(t.shape)
        for p in shard_placements(spec, shape, n):
            ax = axes[row, p.device]
            r, c, rows_total, cols_total = _as_2d(p.index, shape)
            ax.add_patch(Rectangle((0, 0), cols_total, rows_total, fill=False, lw=1))
            ax.add_patch(Rectangle((c.start, r.start), c.stop - c.start, r.stop - r.start,
                                   facecolor=colours(p.device % 10), alpha=0.8, lw=0))
            held = "x".join(map(str, p.shape)) if all(p.shape) else "padding only"
            x, y = ((c.start + c.stop) / 2, (r.start + r.stop) / 2) if all(p.shape) else (
                cols_total / 2, rows_total / 2)
            ax.text(x, y, held, ha="center", va="center", fontsize=8)
            ax.set_xlim(0, cols_total)
            ax.set_ylim(rows_total, 0)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(f"device {p.device}", fontsize=9)
            if p.device == 0:
                ax.set_ylabel(f"{name}\n{'x'.join(map(str, shape))}", rotation=0,
                              ha="right", va="center", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
