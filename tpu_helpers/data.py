"""Datasets that feed a TPU well: checked on the host, fixed shapes, sharded exactly once.

Taught in ``notebooks/01_dataset_setup.ipynb``; ``notebooks/02_parallel_loader.ipynb``
wraps these loaders in ``MpDeviceLoader``; notebooks 03-06 and the benchmarks load the
shipped digits with :func:`load_digits`.

* Data: :func:`data_dir` (the repo's ``data/`` or ``$TPU_NB_DATA``), :func:`load_digits`
  (the shipped 8x8 digits as arrays), :func:`load_tabular_csv` (a CSV read with pandas),
  :class:`ImageFolderDataset` (PNG/JPEG files decoded with PIL, the seed article's
  ``CustomImageDataset`` done right), :class:`ArrayDataset` (in-memory numpy storage that
  forked processes share instead of copying).
* Fixed shapes: :func:`make_train_loader` (``DistributedSampler`` + ``drop_last``) and
  :func:`make_eval_loader` (padding rows with ``index`` and ``mask``, planned by the pure
  :func:`eval_shard_indices`), so XLA compiles one graph and every replica runs the same
  number of steps.

Every check raises :class:`DataError` (a ``ValueError``) naming the file, line or index,
on the host, before anything is sent to the XLA device. Importing this module does not
touch the XLA device; only the loader functions called without ``world_size``/``rank``
ask ``torch_xla.runtime`` for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

if TYPE_CHECKING:
    pass


class DataError(ValueError):
    """Bad input data, explained in one sentence that names the file, line or index."""


# --------------------------------------------------------------------------- where


# --------------------------------------------------------------------------- checks


def check_finite(features: np.ndarray, source: str = "features") -> None:
    """Raise :class:`DataError` naming the first row with a NaN or infinite value."""
    if features.dtype.kind not in "fc":
        return
    bad = ~np.isfinite(features.reshape(len(features), -1)).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise DataError(
            f"{source}: row {rows[0]} has NaN or infinite values "
            f"({len(rows)} bad row(s), first ones: {rows[:5].tolist()})."
        )


def check_labels(labels: np.ndarray, num_classes: int | None, source: str = "labels") -> None:
    """Raise :class:`DataError` naming the first label that is not an integer in range."""
    if labels.ndim != 1:
        raise DataError(f"{source}: labels must be one-dimensional, got shape {labels.shape}.")
    if labels.dtype.kind not in "iu":
        raise DataError(f"{source}: labels must be integers, got dtype {labels.dtype}.")
    low = 0
    bad = labels < low
    if num_classes is not None:
        bad |= labels >= num_classes
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rng = f"0..{num_classes - 1}" if num_classes is not None else ">= 0"
        raise DataError(f"{source}: label {int(labels[i])} at index {i} is out of range {rng}.")


def _stack_rows(rows: Any, what: str) -> np.ndarray:
    """np.asarray that names the first ragged row instead of numpy's generic message."""
    if isinstance(rows, np.ndarray):
        return rows
    if isinstance(rows, torch.Tensor):
        return rows.detach().cpu().numpy()
    if isinstance(rows, Sequence) and not isinstance(rows, str | bytes):
        if len(rows) and all(isinstance(r, Sequence | np.ndarray | torch.Tensor) for r in rows):
            first = np.shape(rows[0])
            for i, r in enumerate(rows):
                try:
                    shape = np.shape(r)
                except ValueError:  # the row itself is ragged
                    shape = None
                if shape != first:
                    raise DataError(
                        f"{what}: row {i} has shape {shape}, row 0 has {first} "
                        "(ragged rows; every sample must have the same shape)."
                    )
    return np.asarray(rows)


# --------------------------------------------------------------------------- arrays


class ArrayDataset(Dataset):
    """In-memory samples in one numpy array per field: ``(x, y)`` tensors per index.

    Storage stays numpy (one buffer, no per-sample Python objects), so processes forked
    after building it share the pages instead of copying them (notebook 01 measures it).
    ``x`` is returned as a tensor view of that buffer; the DataLoader's collate copies
    it into the batch. Checks on construction: same length, not empty, same shape for
    every row, finite features, integer labels (in ``0..num_classes-1`` if given).
    """

    def __init__(self, images: Any, labels: Any, num_classes: int | None = None) -> None:
        x = _stack_rows(images, "images")
        y = _stack_rows(labels, "labels")
        if len(x) == 0:
            raise DataError("ArrayDataset: the dataset is empty (0 samples).")
        if len(x) != len(y):
            raise DataError(f"ArrayDataset: {len(x)} images but {len(y)} labels.")
        if x.dtype.kind == "f" and x.dtype != np.float32:
            x = x.astype(np.float32)
        if y.dtype.kind in "iu" and y.dtype != np.int64:
            y = y.astype(np.int64)
        check_finite(x, "ArrayDataset images")
        check_labels(y, num_classes, "ArrayDataset labels")
        self.images = x
        self.labels = y

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.images[index]), torch.tensor(self.labels[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A whole batch with one numpy gather (the DataLoader uses it when present):
        about 2.5x less host time per batch than 64 ``__getitem__`` calls."""
        rows = np.asarray(indices, dtype=np.int64)
        x = torch.from_numpy(self.images[rows])
        y = torch.from_numpy(self.labels[rows])
        return list(zip(x.unbind(0), y.unbind(0), strict=True))


# --------------------------------------------------------------------------- files


# --------------------------------------------------------------------------- loaders


def _replica(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        import torch_xla.runtime as xr

        world_size = xr.world_size() if world_size is None else world_size
        rank = xr.global_ordinal() if rank is None else rank
    if world_size < 1:
        raise DataError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in 0..{world_size - 1}.")
    return int(world_size), int(rank)


def _check_batch(n: int, batch_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}.")
    if n == 0:
        raise DataError("the dataset is empty (0 samples): nothing to load.")


def train_steps_per_epoch(n: int, batch_size: int, world_size: int) -> int:
    """Full batches each replica runs per epoch under :func:`make_train_loader`."""
    return math.ceil(n / world_size) // batch_size


def make_train_loader(dataset: Dataset, batch_size: int, *, world_size: int | None = None,
                      rank: int | None = None, seed: int = 0,
                      num_workers: int = 0) -> DataLoader:
    """A training DataLoader with one fixed batch shape, sharded across replicas.

    ``DistributedSampler(num_replicas=world_size, rank=rank, shuffle=True, seed=seed)``
    (defaults ``xr.world_size()`` / ``xr.global_ordinal()``) gives every replica
    ``ceil(N / world_size)`` indices (repeating a few to make it divide), and
    ``drop_last=True`` drops the partial last batch, so every step has exactly
    ``batch_size`` rows and every replica runs the same number of steps. Call
    ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle.

    Batches are ``default_collate``'s, after a check that every item has the shapes and
    dtypes of the batch's first one (:class:`DataError` naming both dataset indices).
    ``loader.dataset`` is a thin wrapper that remembers the indices (``.dataset`` is
    yours). Raises :class:`DataError` if a replica cannot get one full batch.
    """
    ws, rk = _replica(world_size, rank)
    n = len(dataset)
    _check_batch(n, batch_size)
    per_replica = math.ceil(n / ws)
    if per_replica < batch_size:
        raise DataError(
            f"training set too small: {n} samples over {ws} replica(s) gives each "
            f"{per_replica} sample(s), fewer than one batch of {batch_size}; use "
            f"batch_size <= {per_replica}, more data, or fewer replicas "
            "(evaluation still works: make_eval_loader pads and masks)."
        )
    sampler = DistributedSampler(dataset, num_replicas=ws, rank=rk, shuffle=True, seed=seed)
    return DataLoader(_IndexedItems(dataset), batch_size=batch_size, sampler=sampler,
                      drop_last=True, num_workers=num_workers, collate_fn=_collate_train)


def eval_shard_indices(n: int, batch_size: int, world_size: int, rank: int) -> np.ndarray:
    """The dataset indices replica ``rank`` evaluates, in order; ``-1`` marks padding.

    The indices ``0..n-1`` are padded with ``-1`` up to a multiple of
    ``batch_size * world_size`` and dealt out round-robin (like ``DistributedSampler``
    with ``shuffle=False``, but padding instead of repeating). So every replica gets the
    same number of full batches, and each index appears on exactly one replica, once.
    Pure: no torch_xla, no I/O.
    """
    _check_batch(n, batch_size)
    _replica(world_size, rank)
    steps = math.ceil(n / (batch_size * world_size))
    padded = np.full(steps * batch_size * world_size, -1, dtype=np.int64)
    padded[:n] = np.arange(n, dtype=np.int64)
    return padded[rank::world_size].copy()


class PaddedEvalDataset(Dataset):
    """Wraps a ``(x, y)`` dataset: item ``i`` is ``(x, y, i, True)``; item ``-1`` is a
    padding row ``(zeros like x, zeros like y, -1, False)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._padding: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def _pad_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._padding is None:
            x, y = self.dataset[0]
            self._padding = (torch.zeros_like(torch.as_tensor(x)),
                             torch.zeros_like(torch.as_tensor(y)))
        return self._padding

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index < 0:
            x, y = self._pad_row()
            return x, y, torch.tensor(-1, dtype=torch.int64), torch.tensor(False)
        x, y = self.dataset[index]
        return (torch.as_tensor(x), torch.as_tensor(y), torch.tensor(index, dtype=torch.int64),
                torch.tensor(True))


def make_eval_loader(dataset: Dataset, batch_size: int, *, world_size: int | None = None,
                     rank: int | None = None, num_workers: int = 0) -> DataLoader:
    """An evaluation DataLoader yielding ``(x, y, index, mask)``, every batch full.

    ``index`` (int64) is each row's dataset index, ``-1`` on padding rows; ``mask``
    (bool) is True on real rows. Every replica runs the same number of steps and, across
    replicas, each dataset index is in exactly one unmasked row (see
    :func:`eval_shard_indices`). Works for any non-empty dataset, even one smaller than
    a batch per replica. Reduce metrics with the mask; gather predictions with the index.

    Batches are ``default_collate``'s, after a check that every row's ``x`` and ``y``
    have the shapes and dtypes of the batch's first real row: an odd item is a
    :class:`DataError` naming its dataset index and both shapes (with worker processes
    too), not a bare "stack expects each tensor to be equal size".
    """
    ws, rk = _replica(world_size, rank)
    indices = eval_shard_indices(len(dataset), batch_size, ws, rk)
    return DataLoader(PaddedEvalDataset(dataset), batch_size=batch_size,
                      sampler=indices.tolist(), shuffle=False, drop_last=False,
                      num_workers=num_workers, collate_fn=_collate_eval)


# --------------------------------------------------------------------------- collate
# Module-level functions (picklable for worker processes). The per-batch cost is one
# dtype scan, about as long as default_collate itself (~0.5 us per (x, y) item); shapes
# cost nothing extra: torch.stack compares them, and they are scanned only if it fails.


def _layout(item: Any, shapes: bool = True) -> Any:
    """What must match across one batch: the dtype (and shape if ``shapes``) of each
    tensor or array, the type of anything else, through tuples, lists and dicts."""
    if isinstance(item, tuple | list):  # the usual (x, y): no call per tensor
        return [((v.shape, v.dtype) if shapes else v.dtype) if isinstance(v, torch.Tensor)
                else _layout(v, shapes) for v in item]
    if isinstance(item, torch.Tensor | np.ndarray):
        return (item.shape, item.dtype) if shapes else item.dtype
    if isinstance(item, Mapping):
        return {k: _layout(v, shapes) for k, v in item.items()}
    return type(item).__name__


def _find_odd(items: Sequence[Any], ref: int, shapes: bool) -> int | None:
    want = _layout(items[ref], shapes)
    return next((i for i, item in enumerate(items) if _layout(item, shapes) != want), None)


def _describe_layout(layout: Any) -> str:
    if isinstance(layout, tuple):
        return f"shape {list(layout[0])} {layout[1]}"
    return f"the layout {layout}" if isinstance(layout, list | dict) else f"a {layout}"


def _odd_item(items: Sequence[Any], odd: int, ref: int,
              index_of: Callable[[int], Any]) -> DataError:
    """The error naming item ``odd``'s dataset index, its first differing field, and
    item ``ref``'s (the batch's first real item)."""
    got, want = _layout(items[odd]), _layout(items[ref])
    field = "the item"
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
        field = ("x", "y")[i] if len(got) == 2 else f"element {i}"
        got, want = got[i], want[i]
    index = index_of(odd)
    if index == -1:
        index = "-1 (a padding row, shaped like dataset index 0)"
    return DataError(
        f"dataset index {index}: {field} has {_describe_layout(got)}, but dataset index "
        f"{index_of(ref)} in the same batch has {_describe_layout(want)}; every item must "
        "have the same shapes and dtypes (fixed shapes: one XLA graph)."
    )


def _checked_collate(batch: list, items: Sequence[Any], ref: int,
                     index_of: Callable[[int], Any]) -> Any:
    """``default_collate(batch)`` once ``items`` (what must match, one per row) all have
    the layout of ``items[ref]``; :class:`DataError` naming the odd row otherwise."""
    odd = _find_odd(items, ref, shapes=False)  # dtypes first: torch.stack promotes them
    if odd is None:
        try:
            return default_collate(batch)
        except Exception as exc:  # torch.stack refuses unequal shapes: find the odd row
            odd = _find_odd(items, ref, shapes=True)
            if odd is None:
                raise
            raise _odd_item(items, odd, ref, index_of) from exc
    raise _odd_item(items, odd, ref, index_of)


def _collate_eval(batch: list[tuple]) -> Any:
    """make_eval_loader's collate of ``(x, y, index, mask)`` rows: ``x`` and ``y``
    checked against the first real (mask True) row's, then ``default_collate``."""
    ref = next((i for i, row in enumerate(batch) if row[3]), 0)
    return _checked_collate(batch, [row[:2] for row in batch], ref,
                            lambda i: int(batch[i][2]))


def _collate_train(batch: list) -> Any:
    """make_train_loader's collate: items checked against the first, then
    ``default_collate``; ``batch.indices`` (from :class:`_IndexedItems`) names them."""
    indices = getattr(batch, "indices", None)
    return _checked_collate(batch, batch, 0,
                            lambda i: indices[i] if indices else f"? (batch row {i})")


class _Batch(list):
    """A list of dataset items that knows their dataset indices."""

    def __init__(self, items: Sequence[Any], indices: Sequence[int]) -> None:
        super().__init__(items)
        self.indices = [int(i) for i in indices]


class _IndexedItems(Dataset):
    """``dataset``'s items, fetched a batch at a time (its own ``__getitems__`` if it
    has one) as a :class:`_Batch`, so the collate can name an odd item's index."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> _Batch:
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return _Batch(items, indices)
