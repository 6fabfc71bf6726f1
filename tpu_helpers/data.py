"""Replica data loading for XLA: fixed batch shapes, each sample once, bad items named.

Taught in notebooks 01 (the raw ``replica_*`` forms, per-replica batch) and 02. Copy this file
alone: torch and numpy only (omitted ``world_size``/``rank`` ask torch_xla's runtime).
:func:`make_train_loader` and :func:`make_eval_loader` take the GLOBAL batch (rows one optimizer
step takes over ALL replicas); every check raises :class:`DataError` naming the row or index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, default_collate


class DataError(ValueError):
    """Bad input data, explained in one sentence that names the file, line or index."""


def check_finite(features: np.ndarray, source: str = "features") -> None:
    """Raise :class:`DataError` naming the first row with a NaN or infinite value."""
    if features.dtype.kind not in "fc":
        return
    rows = np.flatnonzero(~np.isfinite(features.reshape(len(features), -1)).all(axis=1))
    if len(rows):
        raise DataError(f"{source}: row {rows[0]} has NaN or infinite values "
                        f"({len(rows)} bad row(s), first ones: {rows[:5].tolist()}).")


def check_labels(labels: np.ndarray, num_classes: int | None, source: str = "labels",
                 where: Callable[[int], str] | None = None, *, dense: bool = False) -> None:
    """Raise :class:`DataError` naming the first label that is not an integer in range
    (``where(i)`` says where row ``i`` came from, e.g. a CSV line; default: its index).
    ``dense`` (a whole dataset, no ``num_classes``): the labels must be the classes 0..K-1,
    each present; a regression target (say 25..346) is refused, naming its range."""
    if labels.ndim != 1:
        raise DataError(f"{source}: labels must be one-dimensional, got shape {labels.shape}.")
    if labels.dtype.kind not in "iu":
        raise DataError(f"{source}: labels must be integers, got dtype {labels.dtype}.")
    bad = labels < 0
    if num_classes is not None:
        bad |= labels >= num_classes
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rng = f"0..{num_classes - 1}" if num_classes is not None else ">= 0"
        at = where(i) if where else f"label {int(labels[i])} at index {i}"
        raise DataError(f"{source}: {at} is out of range {rng}.")
    present = np.unique(labels)
    if dense and num_classes is None and len(present) and len(present) != present[-1] + 1:
        raise DataError(
            f"{source}: the labels hold {len(present)} distinct values in {present[0]}.."
            f"{present[-1]}, not the classes 0..K-1 ({present[-1] + 1 - len(present)} of "
            f"0..{present[-1]} never occur): a regression target? If these are class ids, "
            f"pass num_classes (e.g. num_classes={present[-1] + 1}).")


def load_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Arrays ``x`` (float32) and ``y`` (int64 class ids 0..K-1, each present; whole floats
    pass) of an ``.npz`` file, read without pickle; a bad ``y`` is a :class:`DataError`."""
    with np.load(path, allow_pickle=False) as f:  # arrays only: nothing can run code
        x, y = f["x"].astype(np.float32), f["y"]
    y = y.astype(np.int64) if y.dtype.kind == "f" and np.array_equal(y, np.round(y)) else y
    check_labels(y, None, f"{path}: y", dense=True)
    return x, y.astype(np.int64)


def _stack_rows(rows: Any, what: str) -> np.ndarray:
    """np.asarray that names the first ragged row instead of numpy's generic message."""
    if isinstance(rows, torch.Tensor):
        return rows.detach().cpu().numpy()
    if (isinstance(rows, Sequence) and not isinstance(rows, str | bytes) and len(rows)
            and all(isinstance(r, Sequence | np.ndarray | torch.Tensor) for r in rows)):
        first = np.shape(rows[0])
        for i, r in enumerate(rows):
            try:
                shape = np.shape(r)
            except ValueError:  # the row itself is ragged
                shape = None
            if shape != first:
                raise DataError(f"{what}: row {i} has shape {shape}, row 0 has {first} "
                                "(ragged rows; every sample must have the same shape).")
    return np.asarray(rows)


class ArrayDataset(Dataset):
    """In-memory samples, one numpy array per field, checked on construction (lengths, row
    shapes, finite features, integer labels in ``0..num_classes-1``); floats become float32."""

    def __init__(self, images: Any, labels: Any, num_classes: int | None = None) -> None:
        x, y = _stack_rows(images, "images"), _stack_rows(labels, "labels")
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
        self.images, self.labels = x, y

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.images[index]), torch.tensor(self.labels[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A whole batch with one numpy gather (the DataLoader uses it when present); a
        subclass that overrides ``__getitem__`` (augmentation) is fetched item by item."""
        if type(self).__getitem__ is not ArrayDataset.__getitem__:
            return [self[i] for i in indices]
        x, y = _gather((self.images, self.labels), indices)
        return list(zip(x.unbind(0), y.unbind(0), strict=True))


def _replica(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        import torch_xla.runtime as xr  # deferred: importing data.py imports no torch_xla

        world_size = xr.world_size() if world_size is None else world_size
        rank = xr.global_ordinal() if rank is None else rank
    if world_size < 1:
        raise DataError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in 0..{world_size - 1}.")
    return int(world_size), int(rank)


def _check_batch(n: int, batch: int, name: str = "global_batch") -> None:
    if batch < 1:
        raise DataError(f"{name} must be >= 1, got {batch}.")
    if n == 0:
        raise DataError("the dataset is empty (0 samples): nothing to load.")


def split_global_batch(global_batch, world_size):
    """One optimizer step takes ``global_batch`` rows over all replicas; each loads its share."""
    if global_batch % world_size:
        raise DataError(f"global batch {global_batch} does not divide over {world_size} "
                        "replicas: make it a multiple of the world size.")
    return global_batch // world_size


def replica_train_loader(dataset, per_replica_batch, world_size, rank, seed=0, **loader_args):
    """This replica's shard of a shuffled order in full batches of ``per_replica_batch`` rows:
    the sampler drops the ragged tail instead of repeating samples, the loader any partial
    batch, so every replica runs the same steps at one shape. ``sampler.set_epoch(e)``
    reshuffles."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)  # no repeated samples
    return DataLoader(dataset, batch_size=per_replica_batch, sampler=sampler, drop_last=True,
                      **loader_args)


def make_train_loader(dataset: Dataset, global_batch: int, *,
                      world_size: int | None = None,
                      rank: int | None = None, seed: int = 0,
                      num_workers: int = 0) -> DataLoader:
    """This replica's loader for ``global_batch`` rows per optimizer step:
    :func:`replica_train_loader`, checked, with a collate naming an odd item's dataset index.
    Every replica runs ``len(dataset) // global_batch`` steps; call
    ``loader.sampler.set_epoch(epoch)`` each epoch."""
    ws, rk = _replica(world_size, rank)
    n = len(dataset)
    _check_batch(n, global_batch)
    batch = split_global_batch(global_batch, ws)
    per_replica = n // ws
    if per_replica < batch:
        raise DataError(f"training set too small: {n} samples over {ws} replica(s) gives "
                        f"each {per_replica}, fewer than one per-replica batch of {batch} "
                        f"(global batch {global_batch}); "
                        + (f"use global_batch <= {per_replica * ws} (a multiple of {ws}), more "
                           "data, or fewer replicas." if per_replica else
                           "use more data or fewer replicas."))
    return replica_train_loader(_IndexedItems(dataset), batch, ws, rk, seed=seed,
                                num_workers=num_workers, collate_fn=_collate_train)


def make_loaders(train_set: Dataset, eval_set: Dataset | None, config: Any, world: int,
                 rank: int) -> tuple[DataLoader, DataLoader | None]:
    """``train.fit``'s loaders for this replica: :func:`make_train_loader` and
    :func:`make_eval_loader` (or None) from ``config.global_batch``, ``eval_global_batch``
    and ``seed`` (GLOBAL batches). Both sets need ``(x, y)`` items: the loss reads ``y``."""
    for name, dataset in (("training", train_set), ("evaluation", eval_set)):
        first = None if dataset is None or not len(dataset) else item_fields(dataset[0])
        if first is not None and len(first) != 2:
            raise DataError(f"{name} set: dataset index 0 has {len(first)} field(s), not (x, y): "
                            "train and evaluate need a label per item (predict does not).")
    train = make_train_loader(train_set, config.global_batch, world_size=world, rank=rank,
                              seed=config.seed)
    return train, None if eval_set is None else make_eval_loader(
        eval_set, config.eval_global_batch, world_size=world, rank=rank)


#: ``train.fit``'s data: a ``Dataset`` of ``(x, y)`` items, ``(x, y, eval_x, eval_y)`` numpy
#: arrays (eval ones may be None), or None (``config.data``, else fake data like upstream's).
AnyData = Dataset | tuple | None


def fit_datasets(data: AnyData, eval_data: Dataset | None,
                 config: Any) -> tuple[Dataset, Dataset | None]:
    """``train.fit``'s training and evaluation ``Dataset``s, from datasets, arrays, ``.npz``
    (``config.data``, ``config.eval_data``) or fake data."""
    if data is None and not config.data:  # 8x8 images, 10 noisy class patterns
        g = np.random.default_rng(0)
        y = g.integers(0, 10, 2560)
        x = g.standard_normal((10, 1, 8, 8))[y] + g.standard_normal((2560, 1, 8, 8))
        data = (x[:2048], y[:2048], x[2048:], y[2048:])
    elif data is None:
        data = (*load_npz(config.data), *(load_npz(config.eval_data) if config.eval_data
                                          else (None, None)))
    if isinstance(data, tuple):
        x, y, ex, ey = data
        data = ArrayDataset(np.asarray(x, np.float32), np.asarray(y, np.int64))
        if ex is not None and eval_data is None:
            eval_data = ArrayDataset(np.asarray(ex, np.float32), np.asarray(ey, np.int64))
    return data, eval_data


def fit_layout(config: Any) -> tuple[int, int, int]:
    """``train.fit``'s (world_size, rank, devices) for ``config.spmd``, both GLOBAL batches
    checked to split over the devices."""
    import torch_xla.runtime as xr  # deferred: importing data.py imports no torch_xla

    if config.spmd != xr.is_spmd():
        raise RuntimeError("config.spmd=True needs xr.use_spmd() first" if config.spmd else
                           "this process is in SPMD mode: pass config.spmd=True")
    world, rank, devices = ((1, 0, xr.global_runtime_device_count()) if config.spmd else
                            (xr.world_size(), xr.global_ordinal(), xr.world_size()))
    for name in ("global_batch", "eval_global_batch"):
        if getattr(config, name) % devices:
            raise ValueError(f"{name}={getattr(config, name)} does not split evenly over "
                             f"{devices} devices; use a multiple of {devices}")
    return world, rank, devices


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """A new shuffle for ``epoch`` (the same on every replica): the sampler's, or a length-bucket
    ``batch_sampler``'s (``buckets.BucketSampler``) if it has ``set_epoch``."""
    bucketed = hasattr(loader.batch_sampler, "set_epoch")
    (loader.batch_sampler if bucketed else loader.sampler).set_epoch(epoch)


def replica_eval_indices(n, per_replica_batch, world_size, rank):
    """The dataset indices replica ``rank`` evaluates: ``0..n-1`` padded with ``-1`` to whole
    steps (every replica as many full batches), dealt round-robin, each index once. Pure."""
    per_step = per_replica_batch * world_size           # rows one step takes, all replicas
    padded = list(range(n)) + [-1] * (-n % per_step)    # pad to whole steps with -1
    return padded[rank::world_size]                      # dealt like DistributedSampler


def item_fields(item: Any) -> tuple[Any, ...]:
    """A dataset item as fields: a tuple's or list's elements (``(x, y)``, ``(x,)``), else the
    item itself (an unlabelled tensor, array or dict), so ``fields[0]`` is the model's input."""
    return tuple(item) if isinstance(item, tuple | list) else (item,)


def _as_tensors(value: Any, blank: bool = False) -> Any:
    """Tensors of a field (a dict's values, a string kept), or zeros like them (``blank``)."""
    if isinstance(value, Mapping):
        return {k: _as_tensors(v, blank) for k, v in value.items()}
    if isinstance(value, str | bytes):
        return type(value)() if blank else value
    value = torch.as_tensor(value)
    return torch.zeros_like(value) if blank else value


class PaddedEvalDataset(Dataset):
    """Item ``i`` is ``(*fields, i, True)``: ``(x, y, i, True)`` for an ``(x, y)`` item,
    ``(x, i, True)`` for an unlabelled one (:func:`item_fields`); item ``-1`` is item 0's
    fields zeroed, ``-1``, ``False``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._padding: tuple[Any, ...] | None = None  # built once, from item 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if index < 0:
            if self._padding is None:
                blank = (_as_tensors(v, blank=True) for v in item_fields(self.dataset[0]))
                self._padding = (*blank, torch.tensor(-1), torch.tensor(False))
            return self._padding
        fields = (_as_tensors(v) for v in item_fields(self.dataset[index]))
        return *fields, torch.tensor(index, dtype=torch.int64), torch.tensor(True)


def replica_eval_loader(dataset, per_replica_batch, world_size, rank, **loader_args):
    """Batches of ``(*fields, index, mask)`` (:class:`PaddedEvalDataset`); padding rows are
    zeros, ``-1``, ``False``."""
    return DataLoader(PaddedEvalDataset(dataset), batch_size=per_replica_batch,
                      sampler=replica_eval_indices(len(dataset), per_replica_batch, world_size,
                                                   rank),
                      **loader_args)


def make_eval_loader(dataset: Dataset, global_batch: int, *,
                     world_size: int | None = None, rank: int | None = None,
                     num_workers: int = 0) -> DataLoader:
    """This replica's evaluation loader for ``global_batch`` rows per step:
    :func:`replica_eval_loader`, checked: full ``(x, y, index, mask)`` batches (``(x, index,
    mask)`` for unlabelled items), as many on every replica; each dataset index is in one
    unmasked row. Reduce with the mask."""
    ws, rk = _replica(world_size, rank)
    _check_batch(len(dataset), global_batch)
    return replica_eval_loader(dataset, split_global_batch(global_batch, ws), ws, rk,
                               num_workers=num_workers, collate_fn=_collate_eval)


# The checking collates (module-level: picklable). Dtypes are scanned per batch, shapes
# only when torch.stack fails.
def _layout(item: Any, shapes: bool = True) -> Any:
    """What must match across a batch: dtypes (and shapes), types, through containers."""
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
    """The error naming item ``odd``'s dataset index and first differing field."""
    got, want = _layout(items[odd]), _layout(items[ref])
    field = "the item"
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
        field = ("x", "y")[i] if len(got) == 2 else "x" if len(got) == 1 else f"element {i}"
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
    """``default_collate(batch)`` if all ``items`` match ``items[ref]``, else DataError."""
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
    """``(*fields, index, mask)`` rows: the fields checked against the first real row's."""
    ref = next((i for i, row in enumerate(batch) if row[-1]), 0)
    return _checked_collate(batch, [row[:-2] for row in batch], ref, lambda i: int(batch[i][-2]))


def _collate_train(batch: list) -> Any:
    """Items checked against the first; ``batch.indices`` (:class:`_IndexedItems`). A
    :class:`_Gathered` batch is already collated (one shape and dtype per field)."""
    if isinstance(batch, _Gathered):
        return list(batch)
    indices = getattr(batch, "indices", None)
    return _checked_collate(batch, batch, 0,
                            lambda i: indices[i] if indices else f"? (batch row {i})")


class _Batch(list):
    """A list of dataset items that knows their dataset ``indices``."""

    indices: list[int]


class _Gathered(list):
    """A batch's fields, each gathered whole from an in-memory dataset: already collated."""


def _gather(arrays: Sequence[Any], indices: list[int]) -> list[torch.Tensor]:
    """Rows ``indices`` of each numpy array or tensor, as tensors: one index op per field."""
    rows = np.asarray(indices, dtype=np.int64)
    return [torch.from_numpy(a[rows]) if isinstance(a, np.ndarray)
            else a[torch.from_numpy(rows)].contiguous() for a in arrays]


def _whole_arrays(dataset: Dataset) -> tuple[Any, ...] | None:
    """The whole-dataset arrays of an :class:`ArrayDataset` or ``TensorDataset`` whose items
    are rows of them (a subclass overriding the item methods: None, fetched per item)."""
    for cls, fields in ((ArrayDataset, ("images", "labels")), (TensorDataset, None)):
        kind = type(dataset)
        if (isinstance(dataset, cls) and kind.__getitem__ is cls.__getitem__
                and getattr(kind, "__getitems__", None) is getattr(cls, "__getitems__", None)):
            return dataset.tensors if fields is None else tuple(getattr(dataset, f) for f in fields)
    return None


class _IndexedItems(Dataset):
    """Fetches a batch as a :class:`_Batch` (the train collate names an odd item's index),
    or, from in-memory arrays, as a :class:`_Gathered` batch: one gather per field, equal to
    collating the items (no per-item fetch, no per-item check: the rows share one layout)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.arrays = _whole_arrays(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> _Batch | _Gathered:
        if self.arrays is not None:
            return _Gathered(_gather(self.arrays, indices))
        getitems = getattr(self.dataset, "__getitems__", None)
        batch = _Batch(getitems(indices) if getitems else [self.dataset[i] for i in indices])
        batch.indices = [int(i) for i in indices]
        return batch
