"""Every prediction exactly once, in dataset order, from every replica.

Taught in ``notebooks/04_prediction_gathering.ipynb``.

The ordering and de-duplication is one pure function of host arrays,
:func:`exactly_once` ``(index, mask, values)``; :class:`OrderedBuffer` applies it chunk by
chunk so the host never holds more than the final result plus one chunk. Every backend
only moves tensors and hands them to it:

* :class:`XlaReplicas`: the processes of ``torch_xla.launch`` (8 on a v5e-8, 1 on Colab's
  v5e-1 and on XLA:CPU). Each step's outputs and ``(index, mask)`` are gathered on device
  with ``xm.all_gather`` inside the one compiled step graph (every replica has the same
  shapes: :func:`tpu_helpers.data.make_eval_loader` pads and masks), stay on device, and
  reach the master's host in one transfer per chunk.
* :class:`SpmdMesh`: one process under ``xr.use_spmd()``; the global batch is sharded over
  the mesh's ``data`` axis, the output stays sharded, and the shards are copied to the
  host in one transfer per chunk (no collective at all).
* :class:`TorchDistributedReplicas`: any ``torch.distributed`` process group (gloo in the
  tests, where XLA:CPU cannot run cross-process collectives), same loop, same ordering.
* ``predict(..., shard_dir=...)``: for outputs too big to gather, every rank writes its
  own shard files and the master merges them with :func:`merge_shards` (count checked).

:func:`predict` returns :class:`Predictions` (``.values`` in dataset order, ``.frame`` a
pandas DataFrame indexed by dataset index, ``.to_csv`` written atomically) on the master
and ``None`` on the other ranks (``all_ranks=True`` returns it everywhere).
``tpu_helpers.lightning.ExactlyOncePredictionWriter`` reuses :func:`exactly_once`.

Bad input (a dataset without indices, a non-tensor output, an output whose shape changes
between batches, a partial batch) raises :class:`PredictionError` on the host, naming
the step and dataset indices, before the offending graph is compiled. Importing this
module does not touch the XLA device.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from tpu_helpers.checkpoint import atomic_write

#: Default bound on the gathered rows held per chunk (device and host), in bytes.
DEFAULT_CHUNK_BYTES = 64 << 20


class PredictionError(ValueError):
    """Bad model output, dataset or gathered rows, found on the host before any hang."""


# --------------------------------------------------------------------------- pure logic


class Ordered(NamedTuple):
    """Rows in dataset order: ``values[i]`` belongs to dataset index ``index[i]``."""

    index: np.ndarray  # int64 [m], strictly increasing
    values: Any  # [m, ...]; numpy array or torch CPU tensor (the kind that was passed in)
    duplicates: int  # real rows dropped because their index had already been seen


def _host_array(a: Any, what: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise TypeError(
                f"{what} is on device {a.device}; exactly_once works on host data: move the "
                "gathered tensors to the host first, in one transfer (not row by row)."
            )
        return a.detach().numpy()
    return np.asarray(a)


def exactly_once(index: Any, mask: Any, values: Any, n: int | None = None, *,
                 complete: bool = True) -> Ordered:
    """Order gathered rows by dataset index, drop padding and repeats, check the count.

    Pure (no torch_xla, no I/O): every backend calls it on what it moved to the host.

    * ``index``: integers, any shape (``[rows]``, or ``[world, steps, batch]`` straight
      from a gather): the dataset index of each row, ``-1`` on padding rows.
    * ``mask``: booleans with ``index``'s shape, True on real rows; ``None`` means
      ``index >= 0``. Masked-out rows are dropped whatever their index (so
      ``DistributedSampler``'s repeated samples can be masked out too).
    * ``values``: numpy array or torch CPU tensor of shape ``index.shape + row_shape``
      (also numpy object arrays, e.g. strings).
    * ``n``: the dataset length. If given, every real index must be in ``0..n-1`` and,
      with ``complete=True``, each of ``0..n-1`` must be present.

    Real rows repeating an index already seen are dropped (the first in gather order
    wins) and counted in ``duplicates``. Returns :class:`Ordered` with ``values`` of the
    same kind as passed in. Raises :class:`PredictionError` naming the row or the missing
    indices, ``TypeError`` for device tensors or non-integer indices.
    """
    idx = _host_array(index, "index")
    if idx.dtype.kind not in "iu":
        raise TypeError(f"index must hold integers, got dtype {idx.dtype}.")
    real = idx >= 0 if mask is None else _host_array(mask, "mask")
    if real.shape != idx.shape:
        raise PredictionError(f"mask has shape {real.shape} but index has {idx.shape}.")
    real = real.astype(bool, copy=False)
    if isinstance(values, torch.Tensor):
        _host_array(values, "values")  # device check
    vshape = tuple(values.shape)
    if vshape[: idx.ndim] != idx.shape:
        raise PredictionError(
            f"values have shape {vshape}; their leading dimensions must equal the index "
            f"shape {idx.shape} (one row per index)."
        )
    row_shape = vshape[idx.ndim:]
    flat_idx = idx.reshape(-1).astype(np.int64, copy=False)
    real_pos = np.flatnonzero(real.reshape(-1))
    real_idx = flat_idx[real_pos]
    if real_idx.size:
        low = int(np.argmin(real_idx))
        if real_idx[low] < 0:
            row = np.unravel_index(real_pos[low], idx.shape)
            raise PredictionError(
                f"row {tuple(int(r) for r in row)} is marked real (mask True) but has index "
                f"{int(real_idx[low])}: padding rows must have mask False."
            )
        high = int(np.argmax(real_idx))
        if n is not None and real_idx[high] >= n:
            row = np.unravel_index(real_pos[high], idx.shape)
            raise PredictionError(
                f"row {tuple(int(r) for r in row)} has dataset index {int(real_idx[high])}, "
                f"out of range for a dataset of {n} samples."
            )
    order = np.argsort(real_idx, kind="stable")
    sorted_idx = real_idx[order]
    first = np.ones(sorted_idx.shape, dtype=bool)
    first[1:] = sorted_idx[1:] != sorted_idx[:-1]
    keep = real_pos[order[first]]
    out_idx = sorted_idx[first]
    if n is not None and complete and out_idx.size != n:
        missing = np.setdiff1d(np.arange(n, dtype=np.int64), out_idx, assume_unique=True)
        raise PredictionError(
            f"{missing.size} of {n} dataset indices are missing from the gathered rows "
            f"(first: {missing[:8].tolist()}): a replica's rows were lost or never gathered."
        )
    if isinstance(values, torch.Tensor):
        flat = values.reshape(-1, *row_shape)
        picked = flat.index_select(0, torch.from_numpy(keep))
    else:
        picked = np.asarray(values).reshape(-1, *row_shape)[keep]
    return Ordered(out_idx, picked, int(sorted_idx.size - out_idx.size))


def _numpy_rows(values: Any) -> np.ndarray:
    """Host rows as numpy; bfloat16 (no numpy dtype) becomes float32, exactly."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bfloat16:
            values = values.float()
        return values.numpy()
    return np.asarray(values)


class OrderedBuffer:
    """:func:`exactly_once` over chunks: host memory is the result plus one chunk.

    ``add(index, mask, values)`` for each gathered chunk (any order, any split), then
    ``result()``. The result array ``[n, ...]`` is allocated once on the first ``add``;
    each chunk is ordered and de-duplicated by :func:`exactly_once` and written into it.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise PredictionError(f"the dataset is empty (n={n}): nothing to predict.")
        self.n = n
        self.duplicates = 0
        self.padding_rows = 0
        self.chunk_bytes_max = 0
        self._seen = np.zeros(n, dtype=bool)
        self._values: np.ndarray | None = None

    @property
    def result_bytes(self) -> int:
        return 0 if self._values is None else int(self._values.nbytes + self._seen.nbytes)

    def add(self, index: Any, mask: Any, values: Any) -> None:
        part = exactly_once(index, mask, values, n=self.n, complete=False)
        rows = _numpy_rows(part.values)
        total = int(np.prod(np.shape(index)))
        self.padding_rows += total - int(part.index.size) - part.duplicates
        nbytes = values.nbytes if isinstance(values, np.ndarray) else \
            values.nelement() * values.element_size()
        self.chunk_bytes_max = max(self.chunk_bytes_max, int(nbytes))
        self._check_rows(rows)
        again = self._seen[part.index]
        self.duplicates += part.duplicates + int(again.sum())
        new = part.index[~again]
        self._values[new] = rows[~again]
        self._seen[new] = True

    def add_many(self, parts: Sequence[tuple[Any, Any, Any]]) -> None:
        """``add`` for many ``(index, mask, values)`` parts at once (e.g. one per step of a
        chunk) without concatenating their values: :func:`exactly_once` orders the parts'
        row positions, then each part's rows are written straight into the result."""
        if len(parts) <= 1:
            if parts:
                self.add(*parts[0])
            return
        indices = [_host_array(i, "index") for i, _, _ in parts]
        for i, (_, _, v) in zip(indices, parts, strict=True):
            if tuple(v.shape[: i.ndim]) != i.shape:
                raise PredictionError(f"values have shape {tuple(v.shape)}; their leading "
                                      f"dimensions must equal the index shape {i.shape}.")
        index = np.concatenate([i.reshape(-1) for i in indices])
        mask = np.concatenate([(i >= 0 if m is None else _host_array(m, "mask")).reshape(-1)
                               for i, (_, m, _) in zip(indices, parts, strict=True)])
        sizes = [i.size for i in indices]
        part = exactly_once(index, mask, np.arange(index.size), n=self.n, complete=False)
        self.padding_rows += index.size - int(part.index.size) - part.duplicates
        again = self._seen[part.index]
        self.duplicates += part.duplicates + int(again.sum())
        dest, pos = part.index[~again], part.values[~again]
        starts = np.cumsum([0, *sizes])
        which = np.searchsorted(starts, pos, side="right") - 1
        order = np.argsort(which, kind="stable")
        bounds = np.cumsum([0, *np.bincount(which, minlength=len(parts))])
        for k, (_, _, values) in enumerate(parts):
            rows = _numpy_rows(values)
            rows = rows.reshape(-1, *rows.shape[indices[k].ndim:])
            self.chunk_bytes_max = max(self.chunk_bytes_max, int(rows.nbytes))
            self._check_rows(rows)
            take = order[bounds[k]:bounds[k + 1]]
            self._values[dest[take]] = rows[pos[take] - starts[k]]
            self._seen[dest[take]] = True

    def _check_rows(self, rows: np.ndarray) -> None:
        if self._values is None:
            self._values = np.empty((self.n, *rows.shape[1:]), dtype=rows.dtype)
        elif rows.shape[1:] != self._values.shape[1:] or rows.dtype != self._values.dtype:
            raise PredictionError(
                f"rows of shape {rows.shape[1:]} / {rows.dtype} after rows of shape "
                f"{self._values.shape[1:]} / {self._values.dtype}: every chunk must match."
            )

    def result(self) -> Ordered:
        if self._values is None:
            raise PredictionError("no rows were added: nothing was gathered.")
        if not self._seen.all():
            missing = np.flatnonzero(~self._seen)
            raise PredictionError(
                f"{missing.size} of {self.n} dataset indices are missing from the gathered "
                f"rows (first: {missing[:8].tolist()}): a replica's rows were lost."
            )
        return Ordered(np.arange(self.n, dtype=np.int64), self._values, self.duplicates)


# --------------------------------------------------------------------------- result


@dataclass(frozen=True)
class Predictions:
    """Predictions in dataset order: ``values[i]`` is the output for dataset index ``i``."""

    values: np.ndarray
    columns: tuple[str, ...] | None = None
    duplicates: int = 0  # real rows dropped as repeats (0 with make_eval_loader's padding)
    padding_rows: int = 0  # padding rows dropped (batch x world fill-up)
    compiles: int | None = None  # XLA compiles during the prediction loop
    transfers_from_device: int | None = None  # device-to-host transfers during the loop

    @property
    def index(self) -> np.ndarray:
        return np.arange(len(self.values), dtype=np.int64)

    @property
    def tensor(self) -> torch.Tensor:
        """The same rows as a torch CPU tensor (shares memory with ``values``)."""
        return torch.from_numpy(self.values)

    @property
    def frame(self):
        """A pandas DataFrame indexed by dataset index (``index``); one column per output
        value (``columns``, else ``out`` or ``out_0 .. out_{k-1}``)."""
        import pandas as pd

        flat = self.values.reshape(len(self.values), -1)
        names = list(self.columns) if self.columns else (
            ["out"] if self.values.ndim == 1 else [f"out_{j}" for j in range(flat.shape[1])])
        if len(names) != flat.shape[1]:
            raise PredictionError(f"{len(names)} column names for {flat.shape[1]} values/row.")
        return pd.DataFrame(flat, index=pd.RangeIndex(len(flat), name="index"), columns=names)

    def to_csv(self, path: str | Path) -> Path:
        """Write ``frame`` as CSV atomically (temp file in the same folder, then rename)."""
        frame = self.frame
        return atomic_write(path, frame.to_csv)


# --------------------------------------------------------------------------- backends


class Backend(Protocol):
    """What the prediction loop needs from a runtime. Backends move tensors; they never
    order or de-duplicate (that is :func:`exactly_once`'s job)."""

    world_size: int
    rank: int
    replicas_per_step: int  # batches whose rows one gathered step holds

    def device_batches(self, batches: Iterable[dict[str, torch.Tensor]], x_dim: int
                       ) -> Iterable[dict[str, torch.Tensor]]: ...
    def gather_step(self, out: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]: ...
    def to_host(self, pending: list[list[torch.Tensor]]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def gather_objects(self, obj: Any, tag: str) -> list[Any]: ...
    def barrier(self, tag: str) -> None: ...


def _fetch(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors to the host; XLA tensors in ONE transfer (the call ``xm`` uses internally)."""
    if tensors and tensors[0].device.type == "xla":
        import torch_xla

        return list(torch_xla._XLAC._xla_get_cpu_tensors(tensors))
    return [t.cpu() for t in tensors]


def _pairs(flat: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for k in range(0, len(flat), 2):
        yield flat[k], flat[k + 1]


class XlaReplicas:
    """The replicas of ``torch_xla.launch``: ``xm.all_gather`` on device, one fetch/chunk."""

    def __init__(self, device: torch.device | None = None) -> None:
        import torch_xla
        import torch_xla.runtime as xr

        self.device = device or torch_xla.device()
        self.world_size = xr.world_size()
        self.rank = xr.global_ordinal()
        self.replicas_per_step = self.world_size

    def device_batches(self, batches, x_dim):
        import torch_xla.distributed.parallel_loader as pl

        return pl.MpDeviceLoader(batches, self.device)

    def gather_step(self, out, ids):
        import torch_xla.core.xla_model as xm

        # Same shapes on every replica (padded batches), so the gather cannot hang on a
        # short last batch. Traced into the step graph: no extra compile.
        return [xm.all_gather(out, dim=0), xm.all_gather(ids, dim=0)]


    def to_host(self, pending):
        return _pairs(_fetch([t for pair in pending for t in pair]))

    def gather_objects(self, obj, tag):
        import torch_xla.core.xla_model as xm

        if self.world_size == 1:  # xm.rendezvous warns (inside torch_xla) for nothing
            return [obj]
        return [pickle.loads(b) for b in xm.rendezvous(tag, pickle.dumps(obj))]

    def barrier(self, tag):
        import torch_xla.core.xla_model as xm

        if self.world_size > 1:
            xm.rendezvous(tag)


class SpmdMesh:
    """One SPMD process: the batch sharded over ``axis`` of a mesh; shards fetched as is."""

    def __init__(self, mesh=None, axis: str = "data", device: torch.device | None = None
                 ) -> None:
        import torch_xla
        import torch_xla.runtime as xr

        if not xr.is_spmd():
            raise PredictionError("SpmdMesh needs SPMD mode: call xr.use_spmd() first.")
        if mesh is None:
            from tpu_helpers.spmd import device_mesh

            mesh = device_mesh((axis,))
        if axis not in mesh.axis_names:
            raise PredictionError(f"mesh axes {mesh.axis_names} have no {axis!r} axis.")
        self.mesh, self.axis = mesh, axis
        self.device = device or torch_xla.device()
        self.world_size, self.rank, self.replicas_per_step = 1, 0, 1
        #: Devices the batch is split over: the global batch is batch_size x data_size.
        self.data_size = int(mesh.mesh_shape[mesh.axis_names.index(axis)])

    def _spec(self, ndim: int) -> tuple:
        return (self.axis,) + (None,) * (ndim - 1)

    def device_batches(self, batches, x_dim):
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.spmd as xs

        sharding = {"x": xs.ShardingSpec(self.mesh, self._spec(x_dim)),
                    "ids": xs.ShardingSpec(self.mesh, self._spec(2))}
        return pl.MpDeviceLoader(batches, self.device, input_sharding=sharding)

    def gather_step(self, out, ids):
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(out, self.mesh, self._spec(out.dim()))  # rows stay where they are
        return [out, ids]


    def to_host(self, pending):
        import torch_xla
        import torch_xla.core.xla_model as xm

        flat = [t for pair in pending for t in pair]
        # The newest pending step may still be executing (MpDeviceLoader's sync launches
        # it asynchronously), and reading shards cannot wait for a tensor the way a
        # transfer does: it fails with "async operation is in flight". Wait first.
        xm.wait_device_ops()
        # Each device's shard as is, all in one transfer (fetching the global tensor
        # instead would compile a replication program per tensor).
        shards = torch_xla._XLAC._get_local_shards(flat)
        places = torch_xla._XLAC._get_local_shard_replica_and_indices(flat)
        for k in range(0, len(flat), 2):
            for (out, _), (ids, _), (replica, o_ix), (_, i_ix) in zip(
                    shards[k], shards[k + 1], places[k], places[k + 1], strict=True):
                if o_ix[0] != i_ix[0]:
                    raise PredictionError(f"output shard rows {o_ix[0]} are not index shard "
                                          f"rows {i_ix[0]}: shard the output over rows.")
                if replica == 0:  # copies of the same rows on other mesh axes: skip
                    rows = o_ix[0].stop - o_ix[0].start
                    yield out[:rows], ids[:rows]

    def gather_objects(self, obj, tag):
        return [obj]

    def barrier(self, tag):
        return None


class TorchDistributedReplicas:
    """Replicas joined by a ``torch.distributed`` process group (e.g. gloo on CPU).

    The collective runs on host tensors (one fetch per step); the model may still run
    on an XLA device. The tests use it to run the same loop in real processes, where
    XLA:CPU has no cross-process collectives.
    """

    def __init__(self, device: torch.device | None = None, group=None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise PredictionError("torch.distributed is not initialised: "
                                  "call dist.init_process_group(...) first.")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.replicas_per_step = self.world_size
        if device is None:
            import torch_xla

            device = torch_xla.device()
        self.device = torch.device(device)

    def device_batches(self, batches, x_dim):
        if self.device.type == "xla":
            import torch_xla.distributed.parallel_loader as pl

            return pl.MpDeviceLoader(batches, self.device)
        return ({k: v.to(self.device) for k, v in b.items()} for b in batches)

    def gather_step(self, out, ids):
        import torch.distributed as dist

        if out.device.type == "xla":
            import torch_xla

            # Run the step and keep its result on the device first: a fetch alone runs
            # the graph without keeping the result, so the loader's next sync would
            # compile (a second graph) and run the forward pass again.
            torch_xla.sync()
        gathered = []
        for t in _fetch([out, ids]):
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            gathered.append(torch.cat(parts))
        return gathered


    def to_host(self, pending):
        return _pairs(_fetch([t for pair in pending for t in pair]))

    def gather_objects(self, obj, tag):
        import torch.distributed as dist

        result: list[Any] = [None] * self.world_size
        dist.all_gather_object(result, obj, group=self.group)
        return result

    def barrier(self, tag):
        import torch.distributed as dist

        dist.barrier(group=self.group)


def default_backend(mesh=None) -> Backend:
    """:class:`SpmdMesh` under ``xr.use_spmd()`` (or if a mesh is given), else
    :class:`XlaReplicas` (``torch_xla.launch`` replicas, or world size 1)."""
    import torch_xla.runtime as xr

    if mesh is not None or xr.is_spmd():
        return SpmdMesh(mesh)
    return XlaReplicas()


# --------------------------------------------------------------------------- the loop


class _InputsOnly(torch.utils.data.Dataset):
    """``(x, 0)`` for a dataset whose items are ``x`` or ``(x, ...)``: only x is needed."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self._zero = torch.zeros((), dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        item = self.dataset[i]
        x = item[0] if isinstance(item, tuple | list) else item
        return torch.as_tensor(x), self._zero


def _check_dataset(dataset) -> int:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise PredictionError(
            f"{type(dataset).__name__} has no indices (it is not a map-style dataset with "
            "__len__ and __getitem__): predictions cannot be put back in dataset order. "
            "Wrap the data in a map-style Dataset (e.g. tpu_helpers.data.ArrayDataset)."
        )
    n = len(dataset)
    if n == 0:
        raise PredictionError("the dataset is empty (0 samples): nothing to predict.")
    item = dataset[0]
    x = item[0] if isinstance(item, tuple | list) and item else item
    if not isinstance(x, torch.Tensor | np.ndarray):
        raise PredictionError(f"dataset item 0 holds {_describe(x)}, not a tensor or numpy "
                              "array; the model input must be the item or its first element.")
    return n


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
    return f"a {type(obj).__name__}"


def pack_batch(batch: Any, step: int, batch_size: int) -> dict[str, torch.Tensor]:
    """Check one host batch ``(x, ..., index, mask)`` and pack it as
    ``{"x": x, "ids": int32 [B, 2]}`` (index, mask) so one transfer and one gather carry
    both (int32: every TPU collective handles it; datasets up to 2**31 - 1 rows).

    Raises :class:`PredictionError` for a batch without index or mask, or with another
    number of rows than ``batch_size`` (a partial last batch), naming the batch.
    """
    if not isinstance(batch, tuple | list) or len(batch) < 3:
        raise PredictionError(
            f"batch {step} is {_describe(batch)} without dataset indices: predict needs "
            "batches (x, ..., index, mask); build the loader with "
            "tpu_helpers.data.make_eval_loader, which pads, masks and numbers the rows."
        )
    x, index, mask = batch[0], batch[-2], batch[-1]
    if not (isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32)
            and index.dim() == 1):
        raise PredictionError(
            f"batch {step} has no dataset index: its second-to-last element is "
            f"{_describe(index)}, expected an int64 tensor [B] (-1 on padding rows); build "
            "the loader with tpu_helpers.data.make_eval_loader."
        )
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and mask.shape == index.shape):
        raise PredictionError(
            f"batch {step} has no mask: its last element is {_describe(mask)}, expected a "
            f"bool tensor of shape {tuple(index.shape)} (True = real row)."
        )
    if not isinstance(x, torch.Tensor):
        raise PredictionError(f"batch {step}: the input is {_describe(x)}, not a tensor.")
    rows = int(index.shape[0])
    if rows != batch_size or x.dim() == 0 or x.shape[0] != rows:
        raise PredictionError(
            f"batch {step} has {rows} rows (dataset indices {index[mask][:4].tolist()}...), "
            f"batch 0 had {batch_size}: a partial batch compiles a second graph and makes "
            "all_gather hang on the other replicas; pad and mask instead "
            "(tpu_helpers.data.make_eval_loader)."
        )
    if rows and int(index.max()) >= 2**31 - 1:
        raise PredictionError(f"batch {step}: dataset index {int(index.max())} does not fit "
                              "in int32; split the dataset (predict handles < 2**31 rows).")
    return {"x": x, "ids": torch.stack([index.to(torch.int32), mask.to(torch.int32)], 1)}


class _CheckedBatches:
    """The host batches, checked and packed. MpDeviceLoader iterates this in a thread
    where exceptions vanish silently, so the error is stored and re-raised by the loop."""

    def __init__(self, loader, batch_size: int) -> None:
        self.loader, self.batch_size = loader, batch_size
        self.error: BaseException | None = None
        self.first_indices: dict[int, list[int]] = {}  # per step, for error messages

    def __iter__(self):
        try:
            for step, batch in enumerate(self.loader):
                packed = pack_batch(batch, step, self.batch_size)
                self.first_indices[step] = batch[-2][batch[-1]][:4].tolist()
                self.first_indices.pop(step - 256, None)  # MpDeviceLoader runs < 30 ahead
                yield packed
        except Exception as exc:
            self.error = exc

    def __len__(self) -> int:
        return len(self.loader)


def _first_batch(loader) -> tuple[int, int]:
    """Check batch 0 in the calling thread (errors before anything reaches the device);
    return its ``(rows, x.dim())``."""
    for batch in loader:
        if isinstance(batch, tuple | list) and len(batch) >= 3 and \
                isinstance(batch[-2], torch.Tensor) and batch[-2].dim() == 1:
            rows = int(batch[-2].shape[0])
        else:
            rows = -1
        packed = pack_batch(batch, 0, rows)
        return rows, packed["x"].dim()
    raise PredictionError("the loader yields no batches: nothing to predict.")


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _check_output(out: Any, spec: _Spec | None, rows: int, step: int,
                  first_indices: list[int]) -> _Spec:
    """Shape/dtype checks at trace time: the graph is not compiled yet."""
    if not isinstance(out, torch.Tensor):
        raise PredictionError(
            f"the model returned {_describe(out)} at step {step}; predict needs one tensor "
            "with one row per sample (wrap the model to return e.g. its logits)."
        )
    if out.dim() == 0 or out.shape[0] != rows:
        raise PredictionError(
            f"the model returned shape {tuple(out.shape)} at step {step} for a batch of "
            f"{rows} rows; predict needs one output row per input row."
        )
    got = _Spec(tuple(out.shape), out.dtype)
    if spec is not None and got != spec:
        raise PredictionError(
            f"the model output changed from {list(spec.shape)} {spec.dtype} at step 0 to "
            f"{list(got.shape)} {got.dtype} at step {step} (dataset indices {first_indices}...): a "
            "new shape compiles another graph and makes all_gather hang on the other "
            "replicas; return a fixed shape (pad inside the model)."
        )
    return got


def predict_loader(model: torch.nn.Module, loader, n: int, *, backend: Backend | None = None,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, all_ranks: bool = False,
                   columns: Sequence[str] | None = None, csv_path: str | Path | None = None,
                   shard_dir: str | Path | None = None) -> Predictions | None:
    """Run ``model`` over this replica's padded loader and gather; see :func:`predict`.

    ``loader`` yields ``(x, ..., index, mask)`` batches of one fixed size, sharded for
    this replica (:func:`tpu_helpers.data.make_eval_loader`); ``n`` is the dataset length.
    """
    import torch_xla.core.xla_model as xm

    from tpu_helpers.metrics import snapshot

    backend = backend if backend is not None else default_backend()
    keep = all_ranks or backend.rank == 0
    rows, x_dim = _first_batch(loader)
    buffer = OrderedBuffer(n)
    checked = _CheckedBatches(loader, rows)
    writer = _ShardWriter(shard_dir, backend, n) if shard_dir is not None else None
    was_training = model.training
    model.eval()
    xm.wait_device_ops()
    before = snapshot()
    pending: list[list[torch.Tensor]] = []
    spec: _Spec | None = None
    chunk_steps = steps = 0
    try:
        with torch.no_grad():
            for step, batch in enumerate(backend.device_batches(checked, x_dim)):
                # Fetching this batch ran the previous step's graph (MpDeviceLoader calls
                # torch_xla.sync() before each batch and once after the last): everything
                # pending is on the device now, so a flush is a pure transfer.
                if pending and len(pending) >= chunk_steps:
                    _flush(backend, pending, buffer, writer)
                    pending = []
                x, ids = batch["x"], batch["ids"]
                out = model(x)
                spec = _check_output(out, spec, int(x.shape[0]), step,
                                     checked.first_indices.get(step, []))
                if step == 0:
                    per_row = out[0].nelement() * out.element_size() + ids[0].nelement() * 4
                    step_bytes = per_row * int(x.shape[0]) * (
                        1 if writer else backend.replicas_per_step)
                    chunk_steps = max(1, chunk_bytes // step_bytes)
                if writer is not None:  # own rows only, no collective
                    pending.append([out, ids])
                else:
                    # A collective: every replica runs it, in the same graph (``gathered``
                    # stays referenced until the next sync, so XLA cannot prune it).
                    gathered = backend.gather_step(out, ids)
                    if keep:
                        pending.append(gathered)
                steps += 1
        if checked.error is not None:
            raise checked.error
        if steps != len(checked):
            raise PredictionError(f"the loader stopped after {steps} of {len(checked)} "
                                  "batches; replicas must all run the same steps.")
        if pending:
            _flush(backend, pending, buffer, writer)
            pending = []
    finally:
        model.train(was_training)
    xm.wait_device_ops()
    counts = snapshot() - before
    cols = tuple(columns) if columns else None
    if writer is not None:
        writer.finish()
        backend.barrier("tpu_helpers.predict.shards")
        if not keep:
            return None
        merged = merge_shards(shard_dir, n, backend.world_size)
        result = Predictions(merged.values, cols, merged.duplicates, 0, counts.compiles,
                             counts.transfers_from_device)
    else:
        if not keep:
            return None
        ordered = buffer.result()
        result = Predictions(ordered.values, cols, ordered.duplicates, buffer.padding_rows,
                             counts.compiles, counts.transfers_from_device)
    if csv_path is not None and backend.rank == 0:
        result.to_csv(csv_path)
    return result


def _flush(backend: Backend, pending: list[list[torch.Tensor]], buffer: OrderedBuffer,
           writer: _ShardWriter | None) -> None:
    parts = backend.to_host(pending)
    if writer is not None:
        writer.write(list(parts))
        return
    buffer.add_many([(ids[:, 0], ids[:, 1] != 0, out) for out, ids in parts])


def predict(model: torch.nn.Module, dataset, batch_size: int, *,
            backend: Backend | None = None, mesh=None, all_ranks: bool = False,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, columns: Sequence[str] | None = None,
            csv_path: str | Path | None = None, shard_dir: str | Path | None = None,
            num_workers: int = 0) -> Predictions | None:
    """Predict every sample of ``dataset`` exactly once, in dataset order, on every replica.

    Call it on every replica: inside ``torch_xla.launch`` (default backend
    :class:`XlaReplicas`, world size 1 included), in an SPMD process (``xr.use_spmd()``:
    :class:`SpmdMesh` over ``mesh`` or all devices), or in each process of a
    ``torch.distributed`` group (``backend=TorchDistributedReplicas()``). ``dataset`` is
    map-style; its items are ``x`` or ``(x, ...)``. ``batch_size`` is per replica (per
    device under SPMD). The model must already be on the device; it runs in eval mode
    under ``torch.no_grad()`` and its mode is restored.

    * Fixed shapes: batches come from :func:`tpu_helpers.data.make_eval_loader` (padded
      with index -1 and mask False), so one step graph is compiled whatever
      ``len(dataset) % (batch_size * world)`` is; ``Predictions.compiles`` counts them.
    * Gathering: outputs and ``(index, mask)`` are gathered every step on device inside
      the step graph, and reach the master's host in one transfer per chunk of at most
      ``chunk_bytes`` (the whole run when it is small), where :class:`OrderedBuffer`
      orders and de-duplicates them: host memory is the result plus one chunk.
    * ``shard_dir``: no gather; each rank writes its own rows to shard files there and
      the master merges them (:func:`merge_shards`, counts checked).
    * ``csv_path``: the master writes ``Predictions.frame`` there atomically.

    Returns :class:`Predictions` on the master (on every rank with ``all_ranks=True``),
    ``None`` elsewhere. Raises :class:`PredictionError` on bad input (no indices,
    non-tensor output, output shape changing, partial batch) before it can compile the
    offending graph or hang a collective.
    """
    n = _check_dataset(dataset)
    if batch_size < 1:
        raise PredictionError(f"batch_size must be >= 1, got {batch_size}.")
    from tpu_helpers.data import make_eval_loader

    backend = backend if backend is not None else default_backend(mesh)
    item = dataset[0]
    if not (isinstance(item, tuple | list) and len(item) == 2):
        dataset = _InputsOnly(dataset)  # make_eval_loader wants (x, y) items
    if isinstance(backend, SpmdMesh):  # one global batch per step, sharded by the loader
        loader = make_eval_loader(dataset, batch_size * backend.data_size,
                                  world_size=1, rank=0, num_workers=num_workers)
    else:
        loader = make_eval_loader(dataset, batch_size, world_size=backend.world_size,
                                  rank=backend.rank, num_workers=num_workers)
    return predict_loader(model, loader, n, backend=backend, chunk_bytes=chunk_bytes,
                          all_ranks=all_ranks, columns=columns, csv_path=csv_path,
                          shard_dir=shard_dir)


# --------------------------------------------------------------------------- host objects


def gather_host_rows(index: Any, mask: Any, objects: Sequence[Any], n: int,
                     backend: Backend, tag: str = "tpu_helpers.predict.rows") -> Ordered:
    """Small per-row host objects (ids, strings) from every rank, exactly once, in order.

    Each rank passes the ``index``/``mask`` of the rows it handled and one object per
    row; they are pickled and gathered on the host (``xm.rendezvous`` under launch,
    ``all_gather_object`` with torch.distributed) and ordered by :func:`exactly_once`.
    Every rank gets the result. For tensors, gather on device instead.
    """
    idx = np.asarray(_host_array(index, "index"), dtype=np.int64).reshape(-1)
    msk = idx >= 0 if mask is None else np.asarray(_host_array(mask, "mask"), bool).reshape(-1)
    objs = np.empty(len(objects), dtype=object)
    objs[:] = list(objects)
    if objs.shape != idx.shape:
        raise PredictionError(f"{len(objects)} objects for {idx.size} index rows.")
    parts = backend.gather_objects((idx, msk, objs), tag)
    return exactly_once(np.concatenate([p[0] for p in parts]),
                        np.concatenate([p[1] for p in parts]),
                        np.concatenate([p[2] for p in parts]), n=n)


# --------------------------------------------------------------------------- shard files


def _manifest_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.json"


def _chunk_name(rank: int, world_size: int, chunk: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}-chunk{chunk:05d}.npz"


class _ShardWriter:
    """One rank's shard files: ``rankR-of-W-chunkC.npz`` (index, mask, values) and, last,
    the manifest ``rankR-of-W.json`` with the chunk and row counts; all atomic."""

    def __init__(self, shard_dir: str | Path, backend: Backend, n: int) -> None:
        self.dir = Path(shard_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.n = backend.rank, backend.world_size, n
        self.chunks = 0
        self.rows = 0
        for old in self.dir.glob(f"rank{self.rank:05d}-of-{self.world_size:05d}*"):
            old.unlink()  # this rank's files from an earlier run

    def write(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        values = np.concatenate([_numpy_rows(out) for out, _ in parts])
        ids = np.concatenate([i.numpy() for _, i in parts])
        path = self.dir / _chunk_name(self.rank, self.world_size, self.chunks)

        atomic_write(path, lambda f: np.savez(f, index=ids[:, 0], mask=ids[:, 1] != 0,
                                              values=values))
        self.chunks += 1
        self.rows += int((ids[:, 1] != 0).sum())

    def finish(self) -> None:
        info = {"rank": self.rank, "world_size": self.world_size, "n": self.n,
                "chunks": self.chunks, "rows": self.rows}
        atomic_write(self.dir / _manifest_name(self.rank, self.world_size),
                     lambda f: f.write(json.dumps(info).encode()))


def _read_manifest(manifest: Path, n: int) -> dict[str, int]:
    """A rank's manifest (plain JSON: nothing in it can run), checked."""
    try:
        info = json.loads(manifest.read_text())
    except (ValueError, OSError) as exc:
        raise PredictionError(f"{manifest}: not a readable shard manifest ({exc}).") from exc
    if not (isinstance(info, dict) and all(isinstance(info.get(k), int)
                                           for k in ("n", "chunks", "rows"))):
        raise PredictionError(f"{manifest}: not a shard manifest (needs integer n, chunks "
                              "and rows).")
    if info["n"] != n:
        raise PredictionError(f"{manifest}: written for a dataset of {info['n']} "
                              f"samples, merging for {n}.")
    return info


def _read_chunk(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One shard file's arrays, loaded without pickle (an object array is refused)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["index"], z["mask"], z["values"]
    except ValueError as exc:
        if "pickle" in str(exc):
            raise PredictionError(
                f"{path}: refused: not a plain shard file, it holds pickled Python objects "
                "(loaded with allow_pickle=False: nothing from it was run).") from None
        raise PredictionError(f"{path}: corrupt shard file ({exc}).") from exc
    except (OSError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise PredictionError(f"{path}: corrupt or truncated shard file "
                              f"({type(exc).__name__}: {exc}).") from exc


def merge_shards(shard_dir: str | Path, n: int, world_size: int) -> Ordered:
    """Merge every rank's shard files into dataset order, one file in memory at a time.

    Checks: every rank's manifest and chunk files exist, each file holds the rows its
    manifest counts, and the rows cover ``0..n-1`` exactly once (repeats are dropped and
    counted). Files are read as JSON and as numpy arrays without pickle, so a crafted
    file cannot run code. Raises :class:`PredictionError` naming the missing,
    inconsistent or refused file.
    """
    shard_dir = Path(shard_dir)
    buffer = OrderedBuffer(n)
    for rank in range(world_size):
        manifest = shard_dir / _manifest_name(rank, world_size)
        if not manifest.is_file():
            raise PredictionError(f"{manifest}: missing; rank {rank} did not finish writing "
                                  "its predictions.")
        info = _read_manifest(manifest, n)
        rows = 0
        for chunk in range(info["chunks"]):
            path = shard_dir / _chunk_name(rank, world_size, chunk)
            if not path.is_file():
                raise PredictionError(f"{path}: missing (listed in {manifest.name}).")
            index, mask, values = _read_chunk(path)
            buffer.add(index, mask, values)
            rows += int(mask.sum())
        if rows != info["rows"]:
            raise PredictionError(f"{manifest}: says {info['rows']} rows, its chunk files "
                                  f"hold {rows}.")
    return buffer.result()
