"""Predictions from every replica, exactly once, in dataset order: the loop and the backends.

Taught in ``notebooks/04_prediction_gathering.ipynb``; needs ``ordering.py`` (the ordering).

``predict(model, loader)`` runs on every replica over a loader the caller built: full
batches ``(x, ..., index, mask)``, padded with index -1 / mask False
(``tpu_helpers.data.make_eval_loader``). Backends only move the rows: :class:`XlaReplicas`
(``torch_xla.launch``: ``xm.all_gather`` inside the step graph), :class:`SpmdMesh` (one
SPMD process: shards copied as they are), :class:`TorchDistributedReplicas` (gloo in the
tests). Rows reach the master's host in one transfer per chunk and
``ordering.OrderedBuffer`` orders them. ``PredictOptions(gather=False)``: no collective,
each rank gets its own rows for a rank file (``ordering.save_rank_file``) that the master
merges (``ordering.merge_rank_files``). Bad input raises :class:`PredictionError` on the
host, naming the step and indices, before its graph compiles. Importing this module does
not touch the XLA device (importing torch_xla does not start its runtime).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

try:  # inside the tpu_helpers package
    from .ordering import Ordered, OrderedBuffer, PredictionError, exactly_once
except ImportError:  # copied next to ordering.py into your project
    from ordering import Ordered, OrderedBuffer, PredictionError, exactly_once

#: Default bound on the gathered rows held per chunk (device and host), in bytes.
DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Predictions:
    """``values[i]`` is the output for dataset index ``index[i]`` (all of ``0..n-1`` when
    gathered; this rank's own rows with ``gather=False``)."""

    index: np.ndarray
    values: np.ndarray
    duplicates: int  # real rows dropped as repeats (0 with make_eval_loader's padding)
    padding_rows: int  # padding rows dropped (the batch x world fill-up)
    compiles: int  # XLA compiles during the loop
    transfers_from_device: int  # device-to-host transfers during the loop


# --------------------------------------------------------------------------- backends


class Backend(Protocol):
    """What the loop needs from a runtime: backends move tensors, never order them."""

    world_size: int
    rank: int
    replicas_per_step: int  # batches whose rows one gathered step holds

    def device_batches(self, batches: Any, x_dim: int) -> Any: ...
    def gather_step(self, out: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]: ...
    def to_host(self, pending: list[list[torch.Tensor]]) -> Iterator[tuple]: ...
    def barrier(self, tag: str) -> None: ...


def _fetch_pairs(pending: list[list[torch.Tensor]]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Every pending (out, ids) to the host; XLA tensors in ONE transfer."""
    flat = [t for pair in pending for t in pair]
    if flat and flat[0].device.type == "xla":
        flat = list(torch_xla._XLAC._xla_get_cpu_tensors(flat))  # what xm uses inside
    return ((flat[k].cpu(), flat[k + 1].cpu()) for k in range(0, len(flat), 2))


class XlaReplicas:
    """The replicas of ``torch_xla.launch``: ``xm.all_gather`` on device, one fetch/chunk."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch_xla.device()
        self.world_size = self.replicas_per_step = xr.world_size()
        self.rank = xr.global_ordinal()

    def device_batches(self, batches, x_dim):
        return pl.MpDeviceLoader(batches, self.device)

    def gather_step(self, out, ids):
        # Same shapes on every replica (padded batches), so the gather cannot hang on a
        # short last batch. Traced into the step graph: no extra compile.
        return [xm.all_gather(out, dim=0), xm.all_gather(ids, dim=0)]

    to_host = staticmethod(_fetch_pairs)

    def barrier(self, tag):
        if self.world_size > 1:
            xm.rendezvous(tag)


class SpmdMesh:
    """One SPMD process: the batch sharded over ``axis`` of a mesh; shards fetched as is.

    The loader yields GLOBAL batches (``batch x data_size`` rows, ``world_size=1``)."""

    def __init__(self, mesh: xs.Mesh | None = None, axis: str = "data") -> None:
        if not xr.is_spmd():
            raise PredictionError("SpmdMesh needs SPMD mode: call xr.use_spmd() first.")
        if mesh is None:
            devices = xr.global_runtime_device_count()
            mesh = xs.Mesh(np.arange(devices), (devices,), (axis,))
        if axis not in mesh.axis_names:
            raise PredictionError(f"mesh axes {mesh.axis_names} have no {axis!r} axis.")
        self.mesh, self.axis, self.device = mesh, axis, torch_xla.device()
        self.world_size, self.rank, self.replicas_per_step = 1, 0, 1
        #: Devices the batch is split over: the global batch is batch_size x data_size.
        self.data_size = int(mesh.mesh_shape[mesh.axis_names.index(axis)])

    def _spec(self, ndim: int) -> tuple:
        return (self.axis,) + (None,) * (ndim - 1)

    def device_batches(self, batches, x_dim):
        sharding = {"x": xs.ShardingSpec(self.mesh, self._spec(x_dim)),
                    "ids": xs.ShardingSpec(self.mesh, self._spec(2))}
        return pl.MpDeviceLoader(batches, self.device, input_sharding=sharding)

    def gather_step(self, out, ids):
        xs.mark_sharding(out, self.mesh, self._spec(out.dim()))  # rows stay where they are
        return [out, ids]

    def to_host(self, pending):
        flat = [t for pair in pending for t in pair]
        # The newest step may still run (MpDeviceLoader's sync launches it asynchronously),
        # and reading shards does not wait for it: "async operation is in flight". Wait.
        xm.wait_device_ops()
        # Each device's shard as is, all in one transfer (fetching the global tensor would
        # compile a replication program per tensor).
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

    def barrier(self, tag):
        return None


class TorchDistributedReplicas:
    """Replicas joined by a ``torch.distributed`` group (e.g. gloo, where XLA:CPU has no
    cross-process collectives): the same loop; the gather runs on host tensors."""

    def __init__(self, device: torch.device | None = None, group=None) -> None:
        if not dist.is_initialized():
            raise PredictionError("torch.distributed is not initialised: "
                                  "call dist.init_process_group(...) first.")
        self.group = group
        self.world_size = self.replicas_per_step = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device(device or torch_xla.device())

    def device_batches(self, batches, x_dim):
        if self.device.type == "xla":
            return pl.MpDeviceLoader(batches, self.device)
        return ({k: v.to(self.device) for k, v in b.items()} for b in batches)

    def gather_step(self, out, ids):
        if out.device.type == "xla":
            # Run the step and keep its result on the device: a fetch alone would not keep
            # it, so the loader's next sync would compile a second graph.
            torch_xla.sync()
        gathered = []
        for t in next(_fetch_pairs([[out, ids]])):
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            gathered.append(torch.cat(parts))
        return gathered

    to_host = staticmethod(_fetch_pairs)

    def barrier(self, tag):
        dist.barrier(group=self.group)


def default_backend() -> Backend:
    """:class:`SpmdMesh` under ``xr.use_spmd()``, else :class:`XlaReplicas`."""
    return SpmdMesh() if xr.is_spmd() else XlaReplicas()


# --------------------------------------------------------------------------- checks


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
    return f"a {type(obj).__name__}"


def pack_batch(batch: Any, step: int, batch_size: int) -> dict[str, torch.Tensor]:
    """Check one host batch ``(x, ..., index, mask)``; pack it as ``{"x": x, "ids": int32
    [B, 2]}`` so one transfer and one gather carry index and mask (int32: every TPU
    collective takes it). Raises :class:`PredictionError` naming the batch."""
    if not isinstance(batch, tuple | list) or len(batch) < 3:
        raise PredictionError(
            f"batch {step} is {_describe(batch)} without dataset indices: predict needs "
            "batches (x, ..., index, mask); build the loader with "
            "tpu_helpers.data.make_eval_loader, which pads, masks and numbers the rows.")
    x, index, mask = batch[0], batch[-2], batch[-1]
    if not (isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32)
            and index.dim() == 1):
        raise PredictionError(
            f"batch {step} has no dataset index: its second-to-last element is "
            f"{_describe(index)}, expected an int64 tensor [B] (-1 on padding rows).")
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and mask.shape == index.shape):
        raise PredictionError(f"batch {step} has no mask: its last element is "
                              f"{_describe(mask)}, expected a bool tensor of shape "
                              f"{tuple(index.shape)} (True = real row).")
    if not isinstance(x, torch.Tensor):
        raise PredictionError(f"batch {step}: the input is {_describe(x)}, not a tensor.")
    rows = int(index.shape[0])
    if rows != batch_size or x.dim() == 0 or x.shape[0] != rows:
        raise PredictionError(
            f"batch {step} has {rows} rows (dataset indices {index[mask][:4].tolist()}...), "
            f"batch 0 had {batch_size}: a partial batch compiles a second graph and makes "
            "all_gather hang on the other replicas; pad and mask instead.")
    if rows and int(index.max()) >= 2**31 - 1:
        raise PredictionError(f"batch {step}: dataset index {int(index.max())} does not fit "
                              "in int32 (predict handles < 2**31 rows).")
    return {"x": x, "ids": torch.stack([index.to(torch.int32), mask.to(torch.int32)], 1)}


class _CheckedBatches:
    """The host batches, checked and packed. MpDeviceLoader iterates this in a thread where
    exceptions vanish, so the first error is kept and re-raised by the loop."""

    def __init__(self, loader) -> None:
        self.loader, self.error = loader, None
        self.first_indices: dict[int, list[int]] = {}  # per step, for error messages
        self.rows, self.x_dim = -1, 0
        for batch in loader:  # batch 0, checked in the calling thread
            index = batch[-2] if isinstance(batch, tuple | list) and len(batch) >= 3 else None
            if isinstance(index, torch.Tensor) and index.dim() == 1:
                self.rows = int(index.shape[0])
            self.x_dim = pack_batch(batch, 0, self.rows)["x"].dim()
            return
        raise PredictionError("the loader yields no batches: nothing to predict.")

    def __iter__(self):
        try:
            for step, batch in enumerate(self.loader):
                packed = pack_batch(batch, step, self.rows)
                self.first_indices[step] = batch[-2][batch[-1]][:4].tolist()
                self.first_indices.pop(step - 256, None)  # MpDeviceLoader runs < 30 ahead
                yield packed
        except Exception as exc:
            self.error = exc

    def __len__(self) -> int:
        return len(self.loader)


def _check_output(out: Any, spec: tuple | None, step: int, batches: _CheckedBatches) -> tuple:
    """Shape/dtype checks at trace time, before the step's graph compiles."""
    if not isinstance(out, torch.Tensor):
        raise PredictionError(
            f"the model returned {_describe(out)} at step {step}; predict needs one tensor "
            "with one row per sample (wrap the model to return e.g. its logits).")
    if out.dim() == 0 or out.shape[0] != batches.rows:
        raise PredictionError(
            f"the model returned shape {tuple(out.shape)} at step {step} for a batch of "
            f"{batches.rows} rows; predict needs one output row per input row.")
    got = (list(out.shape), out.dtype)
    if spec is not None and got != spec:
        raise PredictionError(
            f"the model output changed from {spec[0]} {spec[1]} at step 0 to {got[0]} "
            f"{got[1]} at step {step} (dataset indices {batches.first_indices.get(step)}...):"
            " a new shape compiles another graph and makes all_gather hang on the other "
            "replicas; return a fixed shape (pad inside the model).")
    return got


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class PredictOptions:
    """The rarely changed knobs of :func:`predict`."""

    backend: Backend | None = None  # None: SpmdMesh under SPMD, else XlaReplicas
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # gathered bytes per transfer to the host
    all_ranks: bool = False  # return the result on every rank, not only the master
    gather: bool = True  # False: no collective, each rank gets its own rows (rank files)


class _OwnRows:
    """This rank's real rows only (``gather=False``): no [n, ...] array on every rank."""

    def __init__(self) -> None:
        self.parts: list[Ordered] = []
        self.padding_rows = 0

    def add(self, index: np.ndarray, mask: np.ndarray, values: np.ndarray) -> None:
        self.parts.append(exactly_once(index, mask, values, complete=False))
        self.padding_rows += int((~mask).sum())

    def result(self) -> Ordered:
        return exactly_once(np.concatenate([p.index for p in self.parts]), None,
                            np.concatenate([p.values for p in self.parts]))


def _collect(sink: OrderedBuffer | _OwnRows, parts) -> None:
    for out, ids in parts:
        if out.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            out = out.float()
        ids = ids.numpy()
        sink.add(ids[:, 0], ids[:, 1] != 0, out.numpy())


def _run(model, backend: Backend, batches: _CheckedBatches, sink, opts: PredictOptions,
         keep: bool) -> None:
    """The step loop: forward, gather (a collective every replica runs), and every
    ``chunk_steps`` steps one transfer of what is pending to the host."""
    pending: list[list[torch.Tensor]] = []
    spec, chunk_steps, steps = None, 1, 0
    for step, batch in enumerate(backend.device_batches(batches, batches.x_dim)):
        # Fetching this batch ran the previous step (MpDeviceLoader syncs before each batch
        # and after the last): everything pending is on the device, a flush only copies.
        if len(pending) >= chunk_steps:
            _collect(sink, backend.to_host(pending))
            pending = []
        out = model(batch["x"])
        spec = _check_output(out, spec, step, batches)
        if step == 0:
            row_bytes = out[0].nelement() * out.element_size() + 8
            step_rows = batches.rows * (backend.replicas_per_step if opts.gather else 1)
            chunk_steps = max(1, opts.chunk_bytes // (row_bytes * step_rows))
        if opts.gather or backend.world_size == 1:
            moved = backend.gather_step(out, batch["ids"])  # every replica, same graph
        else:
            moved = [out, batch["ids"]]
        if keep:
            pending.append(moved)
        steps += 1
    if batches.error is not None:
        raise batches.error
    if steps != len(batches):
        raise PredictionError(f"the loader stopped after {steps} of {len(batches)} batches; "
                              "replicas must all run the same steps.")
    if pending:
        _collect(sink, backend.to_host(pending))


def _counts() -> tuple[int, int]:
    xm.wait_device_ops()
    return tuple(int((met.metric_data(name) or [0])[0])
                 for name in ("CompileTime", "TransferFromDeviceTime"))


def predict(model: torch.nn.Module, loader, n: int | None = None,
            options: PredictOptions | None = None) -> Predictions | None:
    """Run ``model`` over this replica's ``loader``; every dataset index once, in order.

    Call it on every replica. ``loader`` yields full batches ``(x, ..., index, mask)``
    (``tpu_helpers.data.make_eval_loader``; under SPMD global batches, ``world_size=1``);
    ``n`` is the dataset length (default ``len(loader.dataset)``). The model is on the
    device already; it runs in eval mode under ``torch.no_grad()``, its mode restored.
    One graph is compiled per batch shape, whatever ``n % (batch x world)`` is.

    Returns :class:`Predictions` on the master (every rank with ``all_ranks=True`` or
    ``gather=False``), ``None`` elsewhere. Raises :class:`PredictionError` on bad input
    (no index/mask, non-tensor output, changing output shape, partial batch) before the
    offending graph compiles or a collective can hang.
    """
    opts = options if options is not None else PredictOptions()
    backend = opts.backend if opts.backend is not None else default_backend()
    n = len(loader.dataset) if n is None and hasattr(loader, "dataset") else n
    if n is None:
        raise PredictionError("pass n, the dataset length: this loader has no .dataset.")
    batches = _CheckedBatches(loader)
    keep = not opts.gather or opts.all_ranks or backend.rank == 0
    sink = OrderedBuffer(n) if opts.gather else _OwnRows()
    was_training = model.training
    model.eval()
    compiles, transfers = _counts()
    try:
        with torch.no_grad():
            _run(model, backend, batches, sink, opts, keep)
    finally:
        model.train(was_training)
    compiles_after, transfers_after = _counts()
    if not keep:
        return None
    ordered = sink.result()
    return Predictions(ordered.index, ordered.values, ordered.duplicates, sink.padding_rows,
                       compiles_after - compiles, transfers_after - transfers)
