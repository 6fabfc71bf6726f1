"""Every prediction exactly once, in dataset order: the pure part (numpy + stdlib only).

Taught in notebook 04. Needs no sibling. Rank files carry outputs too big to gather;
``pad_eval_rows`` pads a Hugging Face evaluation set so no loader drops or repeats a row
(notebooks 11 and 12).
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
    index: np.ndarray  # int64 [m], strictly increasing
    values: np.ndarray  # [m, ...]
    duplicates: int  # real rows dropped because their index had already been seen


def _host_array(a: Any, what: str) -> np.ndarray:
    device = getattr(a, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise TypeError(f"{what} is on device {device}: move the gathered tensors to the host "
                        "first, in one transfer.")
    return np.asarray(a)


def _missing(n: int, present: np.ndarray) -> PredictionError:
    missing = np.setdiff1d(np.arange(n, dtype=np.int64), present, assume_unique=True)
    return PredictionError(f"{missing.size} of {n} dataset indices are missing from the gathered "
                           f"rows (first: {missing[:8].tolist()}): a replica's rows were lost.")


def exactly_once(index: Any, mask: Any, values: Any, n: int | None = None, *,
                 complete: bool = True) -> Ordered:
    """Order gathered rows by dataset index, drop padding and repeats, check the count.

    ``index``: integers of any shape (e.g. ``[world, steps, batch]``), -1 on padding; ``mask``:
    True on real rows (``None``: ``index >= 0``); ``values``: ``index.shape + row_shape``. Real
    indices must be in ``0..n-1`` and, with ``complete``, all present. The first repeat in
    gather order wins. :class:`PredictionError` names the bad row or the missing indices.
    """
    idx = _host_array(index, "index")
    if idx.dtype.kind not in "iu":
        raise TypeError(f"index must hold integers, got dtype {idx.dtype}.")
    real = idx >= 0 if mask is None else _host_array(mask, "mask").astype(bool, copy=False)
    if real.shape != idx.shape:
        raise PredictionError(f"mask has shape {real.shape} but index has {idx.shape}.")
    vals = _host_array(values, "values")
    if vals.shape[: idx.ndim] != idx.shape:
        raise PredictionError(f"values have shape {vals.shape}; their leading dimensions must "
                              f"equal the index shape {idx.shape} (one row per index).")
    real_pos = np.flatnonzero(real.reshape(-1))
    real_idx = idx.reshape(-1).astype(np.int64, copy=False)[real_pos]
    bad = (real_idx < 0) if n is None else (real_idx < 0) | (real_idx >= n)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        row, i = tuple(int(r) for r in np.unravel_index(real_pos[k], idx.shape)), real_idx[k]
        raise PredictionError(f"row {row} is marked real (mask True) but has index {i}: padding "
                              "rows must have mask False." if i < 0 else f"row {row} has dataset "
                              f"index {i}, out of range for a dataset of {n} samples.")
    out_idx, first = np.unique(real_idx, return_index=True)  # first occurrence of each
    if n is not None and complete and out_idx.size != n:
        raise _missing(n, out_idx)
    rows = vals.reshape(-1, *vals.shape[idx.ndim:])[real_pos[first]]
    return Ordered(out_idx, rows, int(real_idx.size - out_idx.size))


class OrderedBuffer:
    """:func:`exactly_once` over chunks (``add`` each, then ``result``): host memory is the
    result plus one chunk. Counts ``duplicates``, ``padding_rows`` and ``chunk_bytes_max``."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise PredictionError(f"the dataset is empty (n={n}): nothing to predict.")
        self.n = n
        self.duplicates = self.padding_rows = self.chunk_bytes_max = 0
        self._seen = np.zeros(n, dtype=bool)
        self._values: np.ndarray | None = None

    @property
    def result_bytes(self) -> int:
        return 0 if self._values is None else int(self._values.nbytes + self._seen.nbytes)

    def add(self, index: Any, mask: Any, values: Any) -> None:
        index, values = _host_array(index, "index"), _host_array(values, "values")
        part = exactly_once(index, mask, values, n=self.n, complete=False)
        rows = part.values
        self.padding_rows += index.size - int(part.index.size) - part.duplicates
        self.chunk_bytes_max = max(self.chunk_bytes_max, int(values.nbytes))
        if part.index.size == 0:  # a rank with no rows (fewer samples than ranks): its row
            return  # shape and dtype say nothing (an empty writer cannot know them)
        if self._values is None:
            self._values = np.empty((self.n, *rows.shape[1:]), dtype=rows.dtype)
        elif rows.shape[1:] != self._values.shape[1:] or rows.dtype != self._values.dtype:
            raise PredictionError(
                f"rows of shape {rows.shape[1:]} / {rows.dtype} after rows of shape "
                f"{self._values.shape[1:]} / {self._values.dtype}: every chunk must match.")
        again = self._seen[part.index]
        self.duplicates += part.duplicates + int(again.sum())
        new = part.index[~again]
        self._values[new] = rows[~again]
        self._seen[new] = True

    def result(self) -> Ordered:
        if self._values is None:
            raise PredictionError("no rows were added: nothing was gathered.")
        if not self._seen.all():
            raise _missing(self.n, np.flatnonzero(self._seen))
        return Ordered(np.arange(self.n, dtype=np.int64), self._values, self.duplicates)


def rank_file_name(rank: int, world_size: int) -> str:
    """``rank00000-of-00002.npz``: the file rank ``rank`` of ``world_size`` writes."""
    return f"rank{rank:05d}-of-{world_size:05d}.npz"


def save_rank_file(f: BinaryIO, index: Any, mask: Any, values: Any, *, rank: int,
                   world_size: int, n: int) -> None:
    """One rank's rows (as for :func:`exactly_once`) as a plain ``.npz`` to the open file ``f``;
    write it atomically, e.g. with ``checkpoint.atomic_write``."""
    idx, vals = _host_array(index, "index"), _host_array(values, "values")
    msk = idx >= 0 if mask is None else _host_array(mask, "mask").astype(bool)
    if vals.dtype == object:
        raise PredictionError("rank files hold numeric arrays only (an object array would "
                              "need pickle, which merge_rank_files refuses).")
    np.savez(f, index=idx.reshape(-1), mask=msk.reshape(-1),
             values=vals.reshape(idx.size, *vals.shape[idx.ndim:]),
             rank=rank, world_size=world_size, n=n)


def merge_rank_files(folder: str | Path, world_size: int, n: int) -> Ordered:
    """Every rank's file in ``folder`` in dataset order, one file in memory at a time; read with
    ``allow_pickle=False``. :class:`PredictionError` names a missing, refused or bad file."""
    buffer = OrderedBuffer(n)
    for rank in range(world_size):
        path = Path(folder) / rank_file_name(rank, world_size)
        if not path.is_file():
            raise PredictionError(f"{path}: missing; rank {rank} did not finish writing its "
                                  "predictions.")
        try:
            with np.load(path, allow_pickle=False) as z:
                header = {k: int(z[k]) for k in ("rank", "world_size", "n")}
                arrays = z["index"], z["mask"], z["values"]
        except ValueError as exc:
            if "pickle" in str(exc):
                raise PredictionError(
                    f"{path}: refused: not a plain rank file, it holds pickled Python objects "
                    "(loaded with allow_pickle=False: nothing from it was run).") from None
            raise PredictionError(f"{path}: corrupt rank file ({exc}).") from exc
        except (OSError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise PredictionError(f"{path}: corrupt, truncated or not a rank file "
                                  f"({type(exc).__name__}: {exc}).") from exc
        want = {"rank": rank, "world_size": world_size, "n": n}
        if header != want:
            raise PredictionError(f"{path}: written for {header}, merging {want}.")
        try:
            buffer.add(*arrays)
        except PredictionError as exc:
            raise PredictionError(f"{path}: {exc}") from None
    return buffer.result()


IGNORE_INDEX = -100  #: the label PyTorch's cross-entropy and Hugging Face models skip


def pad_eval_rows(features: list[dict], *, per_replica_batch: int, world_size: int, width: int,
                  pad_id: int, ignore_index: int = IGNORE_INDEX) -> list[dict]:
    """``features`` (tokenized rows: ``input_ids``, ``attention_mask``, ``labels``) plus filler
    rows, every label ``ignore_index``, up to a multiple of the global batch,
    ``per_replica_batch * world_size`` (the Trainer's ``args.world_size``, accelerate's
    ``num_processes``; 1 under SPMD, where ``per_replica_batch`` is the whole batch). Every
    replica's every batch is then full: no loader drops or repeats a row, accelerate's
    ``gather_for_metrics`` has nothing to cut, and the filler adds nothing to a loss over
    labelled tokens. The filler rows are the last ones."""
    if per_replica_batch < 1 or world_size < 1:
        raise ValueError(f"per_replica_batch and world_size must be >= 1, got "
                         f"{per_replica_batch} and {world_size}")
    filler = {"input_ids": [pad_id] * width, "attention_mask": [0] * width,
              "labels": [ignore_index] * width}
    missing = -len(features) % (per_replica_batch * world_size)
    return list(features) + [dict(filler) for _ in range(missing)]
