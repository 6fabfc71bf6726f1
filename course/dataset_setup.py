"""Notebook 01's plumbing (course only): copies of the digits folder, broken in the ways the
notebook shows (notebook 02 corrupts a copy too), and notebook 01's pictures and table. The
lessons (the datasets, the checks, the loaders) stay in the notebook's cells and in
``tpu_helpers/data.py``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from PIL import Image


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:70])


def _relabel(root: Path, old: str, new: str) -> None:
    labels = root / "labels.csv"
    labels.write_text(labels.read_text().replace(old, new))


#: Ways to break a copy of the digits folder (each takes the copy's root), as the issue
#: tracker has seen them; every one must be a ``DataError`` naming the file or line.
IMAGE_CASES: dict[str, Callable[[Path], None]] = {
    "corrupt image": lambda r: (r / "images/0001.png").write_bytes(b"not a png"),
    "truncated image": lambda r: _truncate(r / "images/0002.png"),
    "missing file": lambda r: (r / "images/0003.png").unlink(),
    "label out of range": lambda r: _relabel(r, "images/0005.png,5", "images/0005.png,12"),
    "wrong size (9x8)": lambda r: Image.new("L", (8, 9)).save(r / "images/0004.png"),
    "wrong mode (RGB)": lambda r: Image.new("RGB", (8, 8)).save(r / "images/0004.png"),
    "empty labels.csv": lambda r: (r / "labels.csv").write_text("file,label,split\n"),
}


def copy_digits(digits: Path, labels: pd.DataFrame, rows: int) -> Path:
    """A copy of the first ``rows`` digits (images and ``labels.csv``) in a new temporary
    folder; returns the copy's root."""
    root = Path(tempfile.mkdtemp()) / "digits"
    (root / "images").mkdir(parents=True)
    for f in labels.head(rows).file:
        shutil.copy(Path(digits) / f, root / f)
    labels.head(rows).to_csv(root / "labels.csv", index=False)
    return root


def broken_copy(digits: Path, labels: pd.DataFrame, break_it: Callable[[Path], None],
                rows: int = 8) -> Path:
    """:func:`copy_digits`, then broken by ``break_it(root)``; returns the copy's root."""
    root = copy_digits(digits, labels, rows)
    break_it(root)
    return root


def plot_one_per_label(digits: Path, labels: pd.DataFrame) -> None:
    """The first image of each label, in a row."""
    firsts = labels.groupby("label").head(1)
    fig, axes = plt.subplots(1, len(firsts), figsize=(10, 1.3))
    for ax, (_, row) in zip(axes, firsts.iterrows(), strict=True):
        ax.imshow(Image.open(Path(digits) / row.file), cmap="gray_r")
        ax.set_title(row.label)
        ax.axis("off")
    plt.show()


def plot_uss_extra(extra_mb: pd.Series, dataset_mb: int, processes: int) -> None:
    """Private RAM per process above the baseline (USS, MB), one point per way of building
    the dataset, on a log axis (values below 0.1 MB drawn at 0.1, labelled "< 0.1")."""
    floor = 0.1
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.hlines(extra_mb.index, 0.03, extra_mb.clip(lower=floor), colors="0.7")
    ax.scatter(extra_mb.clip(lower=floor), extra_mb.index, s=80,
               c=[f"C{i}" for i in (3, 2, 1, 0)][:len(extra_mb)], zorder=3)
    for row, mb in enumerate(extra_mb):
        ax.text(max(mb, floor) * 1.35, row, f"{mb:.1f} MB" if mb >= floor else "< 0.1 MB",
                va="center")
    ax.axvline(dataset_mb, color="k", ls=":", label=f"the dataset\n({dataset_mb} MB as numpy)")
    ax.set(xscale="log", xlim=(0.03, 30 * dataset_mb), ylim=(len(extra_mb) - 0.5, -0.5),
           xlabel=f"private RAM per process above baseline (USS, MB, log; mean of {processes})")
    ax.set_title("Per-process copies and Python lists cost the dataset again in every process; "
                 "shared numpy and mmap cost almost nothing", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    plt.show()


def plot_dealt(grid: np.ndarray, n: int) -> None:
    """``grid[rank]``: the indices a ``DistributedSampler(shuffle=False)`` gives each rank;
    those dealt past the ``n`` real indices (the repeats) in orange."""
    replicas, each = grid.shape
    dealt_at = np.arange(grid.size).reshape(each, replicas).T  # place in the dealt order
    again = dealt_at >= n
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.imshow(again, cmap=ListedColormap(["#dde6f2", "#f5a04a"]), aspect="auto")
    for (r, c), i in np.ndenumerate(grid):
        ax.text(c, r, i, ha="center", va="center", fontsize=9)
    ax.set(xticks=range(each), xticklabels=range(1, each + 1), yticks=range(replicas),
           xlabel="sample number in its epoch", ylabel="replica (rank)",
           title=f"{n} indices on {replicas} replicas: {each} each; "
                 f"{sorted(grid[again].tolist())} dealt again (orange)")
    plt.show()


def sharing_table(ways: dict[str, list[list[int]]]) -> pd.DataFrame:
    """One row per way of dealing samples (``{how: [indices of rank 0, rank 1, ...]}``):
    samples per replica, visits, distinct samples, idle replicas, duplicated visits."""
    table = pd.DataFrame([{
        "how": how,
        "samples per replica": [len(s) for s in shards],
        "sample visits": sum(len(s) for s in shards),
        "distinct samples": len({i for s in shards for i in s}),
        "replicas without real data": sum(not s for s in shards),
    } for how, shards in ways.items()]).set_index("how")
    table["duplicated visits"] = table["sample visits"] - table["distinct samples"]
    return table
