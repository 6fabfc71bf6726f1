"""Rows in dataset order, each exactly once, and the rank-file format (numpy only).

STUB written by the lightning slice to code against the contract in PLAN.md; the predict
slice's ordering.py replaces it at merge. Taught in ``notebooks/04_prediction_gathering.ipynb``.
Needs no sibling: numpy and the standard library only.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np


class PredictionError(ValueError):
    """Bad model output, dataset or gathered rows, found on the host before any hang."""


class Ordered(NamedTuple):
    """Rows in dataset order: ``values[i]`` belongs to dataset index ``index[i]``."""

    index: np.ndarray
    values: np.ndarray
    duplicates: int


def exactly_once(index: Any, mask: Any, values: Any, n: int | None = None, *,
                 complete: bool = True) -> Ordered:
    """Order rows by dataset index, drop masked rows and repeats, check ``0..n-1`` are there."""
    idx = np.asarray(index)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"index must hold integers, got dtype {idx.dtype}.")
    real = (idx >= 0) if mask is None else np.asarray(mask).astype(bool)
    vals = np.asarray(values)
    if real.shape != idx.shape or vals.shape[: idx.ndim] != idx.shape:
        raise PredictionError(f"index {idx.shape}, mask {real.shape} and values {vals.shape} "
                              "do not line up (one row per index).")
    flat_idx = idx.reshape(-1).astype(np.int64)
    pos = np.flatnonzero(real.reshape(-1))
    real_idx = flat_idx[pos]
    if real_idx.size and (real_idx.min() < 0 or (n is not None and real_idx.max() >= n)):
        raise PredictionError(f"dataset index out of range 0..{n}: {real_idx.min()}, "
                              f"{real_idx.max()}.")
    order = np.argsort(real_idx, kind="stable")
    sorted_idx = real_idx[order]
    first = np.ones(sorted_idx.shape, dtype=bool)
    first[1:] = sorted_idx[1:] != sorted_idx[:-1]
    out_idx = sorted_idx[first]
    if n is not None and complete and out_idx.size != n:
        missing = np.setdiff1d(np.arange(n), out_idx)
        raise PredictionError(f"{missing.size} of {n} dataset indices are missing from the "
                              f"gathered rows (first: {missing[:8].tolist()}).")
    rows = vals.reshape(-1, *vals.shape[idx.ndim:])[pos[order[first]]]
    return Ordered(out_idx, rows, int(sorted_idx.size - out_idx.size))


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.npz"


def save_rank_file(f: BinaryIO, index: Any, mask: Any, values: Any, *, rank: int,
                   world_size: int, n: int) -> None:
    np.savez(f, index=np.asarray(index, dtype=np.int64), mask=np.asarray(mask, dtype=bool),
             values=np.asarray(values), meta=np.array([rank, world_size, n], dtype=np.int64))


def merge_rank_files(folder: str | Path, world_size: int, n: int) -> Ordered:
    parts = []
    for rank in range(world_size):
        path = Path(folder) / rank_file_name(rank, world_size)
        if not path.is_file():
            raise PredictionError(f"{path}: missing; rank {rank} of {world_size} did not "
                                  "write its rows.")
        try:
            with np.load(path, allow_pickle=False) as z:
                rec = {k: z[k] for k in ("index", "mask", "values", "meta")}
        except (ValueError, OSError, KeyError, zipfile.BadZipFile) as exc:
            raise PredictionError(f"{path}: refused: not a plain rank file ({exc}).") from None
        if rec["meta"].tolist() != [rank, world_size, n]:
            raise PredictionError(f"{path}: written for rank/world_size/n "
                                  f"{rec['meta'].tolist()}, merging {[rank, world_size, n]}.")
        parts.append(rec)
    return exactly_once(np.concatenate([p["index"] for p in parts]),
                        np.concatenate([p["mask"] for p in parts]),
                        np.concatenate([p["values"] for p in parts]), n=n)
