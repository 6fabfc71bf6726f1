"""Course-only figures (notebook 07's shard layout)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib.pyplot as plt
import torch
import torch_xla.runtime as xr
from matplotlib.patches import Rectangle

from tpu_helpers.spmd import ShardPlacement, tensor_placements

#: Wrapper prefixes that say nothing about the layout (FSDPv2 keeps the model in
#: ``_orig_module``; torch.compile in ``_orig_mod``).
WRAPPER_PREFIXES = ("_orig_module.", "_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """``_orig_module.up.weight`` -> ``up.weight``."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _as_2d(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, slice, int, int]:
    """The first two dims of a placement (a 1-D tensor is drawn as one row)."""
    if len(shape) == 0:
        return slice(0, 1), slice(0, 1), 1, 1
    if len(shape) == 1:
        return slice(0, 1), index[0], 1, shape[0]
    return index[0], index[1], shape[0], shape[1]


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.3g} KiB"


def split_words(shape: tuple[int, ...], padded: tuple[int, ...]) -> str:
    """Which dims of a tensor of ``shape`` a shard of ``padded`` shape splits, and how many
    ways: ``rows / 4``, ``columns / 4``, ``dim 0 / 4``; ``whole`` if none (replicated)."""
    names = ["rows", "columns"] if len(shape) == 2 else [f"dim {d}" for d in range(len(shape))]
    parts = [f"{names[d]} / {-(-n // p)}" for d, (n, p) in enumerate(zip(shape, padded,
                                                                        strict=True)) if p < n]
    return ", ".join(parts) or "whole"


def _draw(ax, p: ShardPlacement, shape: tuple[int, ...], colour, itemsize: int) -> None:
    r, c, rows_total, cols_total = _as_2d(p.index, shape)
    ax.add_patch(Rectangle((0, 0), cols_total, rows_total, fill=False, lw=1))
    ax.add_patch(Rectangle((c.start, r.start), c.stop - c.start, r.stop - r.start,
                           facecolor=colour, alpha=0.8, lw=0))
    held = "x".join(map(str, p.shape)) if all(p.shape) else "padding only"
    x, y = ((c.start + c.stop) / 2, (r.start + r.stop) / 2) if all(p.shape) else (
        cols_total / 2, rows_total / 2)
    ax.text(x, y, f"{held}\n{_bytes(math.prod(p.padded_shape) * itemsize)}", ha="center",
            va="center", fontsize=7)
    ax.set_xlim(0, cols_total)
    ax.set_ylim(rows_total, 0)
    ax.set_xticks([])
    ax.set_yticks([])


def held_fraction(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> float:
    """The share of all elements device 0 allocates (padded shards included)."""
    named = dict(tensors.named_parameters() if isinstance(tensors, torch.nn.Module)
                 else tensors)
    held = sum(math.prod(tensor_placements(t)[0].padded_shape) for t in named.values())
    return held / sum(t.numel() for t in named.values())


def plot_shard_layout(tensors: Mapping[str, torch.Tensor] | torch.nn.Module, layout: str,
                      inputs: Mapping[str, torch.Tensor] | None = None):
    """One row per tensor (``inputs`` first, e.g. the batch; wrapper prefixes removed from
    the names), one column per device; each cell outlines the whole tensor and fills what
    that device holds (its shape and padded bytes); each row label says which dims are split.
    The title names the ``layout`` and says how much of the model (and of ``inputs``) each
    device holds."""
    params = dict(tensors.named_parameters() if isinstance(tensors, torch.nn.Module)
                  else tensors.items())
    named = [*(inputs or {}).items(), *params.items()]
    if not named:
        raise ValueError("plot_shard_layout: no tensors to draw")
    n = xr.global_runtime_device_count()
    fig, axes = plt.subplots(len(named), n, figsize=(1.9 * n + 1.9, 0.95 * len(named) + 0.9),
                             squeeze=False)
    for row, (name, t) in enumerate(named):
        shape, places = tuple(t.shape), tensor_placements(t)
        for p in places:
            ax = axes[row, p.device]
            _draw(ax, p, shape, plt.get_cmap("tab10")(p.device % 10), t.element_size())
            if row == 0:
                ax.set_title(f"device {p.device}", fontsize=9)
            if p.device == 0:
                ax.set_ylabel(f"{clean_name(name)}\n{'x'.join(map(str, shape))}\n"
                              f"{split_words(shape, p.padded_shape)}", rotation=0, ha="right",
                              va="center", fontsize=8)
    what = (f"each of {n} devices holds {held_fraction(params):.0%} of the parameters"
            if n > 1 else "one device: it holds all the parameters")
    if inputs and n > 1:
        what += f" and {held_fraction(inputs):.0%} of {', '.join(inputs)}"
    fig.suptitle(f"{layout}\n{what}", fontsize=10)
    fig.tight_layout()
    return fig
