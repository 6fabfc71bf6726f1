"""Predictions from every replica, exactly once, in dataset order: the loop and the backends.

Taught in notebooks 04 and 13; needs ``ordering.py`` (with ``hang_watchdog.py`` beside it, each
batch ticks the watchdog). Batches are ``(x, ..., index, mask)`` (``data.make_eval_loader``,
labelled or not: the model gets ``x``, a tensor or a dict of them) or length-bucket dicts
(``buckets.collate``: the model gets ``(tokens, mask)``). Backends only move rows. Importing this
module does not touch the XLA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
try:  # progress ticks for the hang watchdog, if hang_watchdog.py is here too (no-ops without one)
    from .hang_watchdog import tick
except ImportError:
    try:
        from hang_watchdog import tick
    except ImportError:
        tick = lambda step=None, phase="step": None  # noqa: E731

DEFAULT_CHUNK_BYTES = 64 << 20  #: bound on the gathered rows per chunk (device and host)


@dataclass(frozen=True)
class Predictions:
    """``values[i]`` is the output for dataset index ``index[i]``."""

    index: np.ndarray  # 0..n-1 (this rank's own indices with gather=False)
    values: np.ndarray
    duplicates: int  # real rows dropped as repeats (0 with make_eval_loader's padding)
    padding_rows: int  # padding rows dropped (the batch x world fill-up)
    compiles: int  # XLA compiles during the loop
    transfers_from_device: int  # device-to-host transfers during the loop


def tensors_to_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy many XLA tensors to the host in ONE device-to-host transfer (CPU ones pass).

    A private call because no public one does only this (``t.cpu()``: a transfer per tensor;
    ``torch.cat``: a graph per count; ``xm.do_on_ordinals``: also a rendezvous). ``xm.save`` and
    ``xm.mesh_reduce`` copy through ``_maybe_convert_to_cpu``, which calls this one,
    ``torch_xla._XLAC._xla_get_cpu_tensors`` (``torch_xla/core/xla_model.py``, v2.9.0, v2.8.0)."""
    xla = [t for t in tensors if t.device.type == "xla"]
    copies = iter(torch_xla._XLAC._xla_get_cpu_tensors(xla) if xla else [])
    return [next(copies) if t.device.type == "xla" else t for t in tensors]


def pack_ids(index, mask):
    """``[B, 2]`` int32: each row's dataset index and mask, for one gather (TPU collectives
    take int32)."""
    return torch.stack([index.to(torch.int32), mask.to(torch.int32)], 1)


def gather_step(out, ids):
    """Every replica's rows of ``out`` and ``ids``, in rank order, traced into the step's
    graph: the same shapes on every replica, so one graph (and no hang)."""
    return [xm.all_gather(out, dim=0), xm.all_gather(ids, dim=0)]


def _fetch_pairs(pending: list[list[torch.Tensor]]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Every pending (out, ids) to the host; XLA tensors in ONE transfer."""
    flat = tensors_to_cpu([t for pair in pending for t in pair])
    return ((flat[k], flat[k + 1]) for k in range(0, len(flat), 2))


class XlaReplicas:
    """The replicas of ``torch_xla.launch``: ``xm.all_gather`` on device, one fetch/chunk."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch_xla.device()
        self.world_size, self.rank = xr.world_size(), xr.global_ordinal()

    def device_batches(self, batches, x_dim):
        return pl.MpDeviceLoader(batches, self.device)

    gather_step = staticmethod(gather_step)
    to_host = staticmethod(_fetch_pairs)


class SpmdMesh:
    """One SPMD process: GLOBAL batches (``world_size=1``) sharded over ``axis`` of a mesh."""

    def __init__(self, mesh: xs.Mesh | None = None, axis: str = "data") -> None:
        if not xr.is_spmd():
            raise PredictionError("SpmdMesh needs SPMD mode: call xr.use_spmd() first.")
        devices = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(devices), (devices,), (axis,)) if mesh is None else mesh
        if axis not in mesh.axis_names:
            raise PredictionError(f"mesh axes {mesh.axis_names} have no {axis!r} axis.")
        self.mesh, self.axis, self.device = mesh, axis, torch_xla.device()
        self.world_size, self.rank = 1, 0

    def _spec(self, ndim: int) -> tuple:
        return (self.axis,) + (None,) * (ndim - 1)

    def device_batches(self, batches, x_dim):
        if x_dim is None:
            raise PredictionError("SpmdMesh shards a tensor input; this loader's input is a "
                                  "dict: predict its tensor, or run under torch_xla.launch.")
        sharding = {"x": xs.ShardingSpec(self.mesh, self._spec(x_dim)),
                    "mask": xs.ShardingSpec(self.mesh, self._spec(x_dim)),  # dict batches
                    "ids": xs.ShardingSpec(self.mesh, self._spec(2))}
        return pl.MpDeviceLoader(batches, self.device, input_sharding=sharding)

    def gather_step(self, out, ids):
        xs.mark_sharding(out, self.mesh, self._spec(out.dim()))  # rows stay where they are
        return [out, ids]

    def to_host(self, pending):
        flat = [t for pair in pending for t in pair]
        # Reading shards does not wait for the newest (asynchronous) step: wait. Shards as
        # they are, in one transfer (the global tensor would compile a replication program).
        xm.wait_device_ops()
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


class TorchDistributedReplicas(XlaReplicas):
    """Replicas joined by a ``torch.distributed`` group (e.g. gloo); gathers host tensors."""

    def __init__(self, group=None) -> None:
        if not dist.is_initialized():
            raise PredictionError("call dist.init_process_group(...) first.")
        self.group, self.device = group, torch_xla.device()
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def gather_step(self, out, ids):
        torch_xla.sync()  # run the step first, or the loader's next sync compiles another graph
        gathered = []
        for t in next(_fetch_pairs([[out, ids]])):
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            gathered.append(torch.cat(parts))
        return gathered


def _describe(obj: Any) -> str:
    return (f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
            if isinstance(obj, torch.Tensor) else f"a {type(obj).__name__}")


def _unpack_dict(batch: dict, step: int) -> tuple[Any, Any, Any, Any]:
    """``(tokens, index, row mask, token mask)`` of a length-bucket batch (``collate``'s)."""
    tokens, mask, index = (batch.get(k) for k in ("tokens", "mask", "index"))
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2
            and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and mask.shape == tokens.shape and isinstance(index, torch.Tensor)
            and index.dim() == 1 and index.dtype in (torch.int64, torch.int32)
            and index.shape[0] == tokens.shape[0]):
        got = ", ".join(f"{k}: {_describe(batch.get(k))}" for k in ("tokens", "mask", "index"))
        raise PredictionError(f"batch {step}: a dict batch needs tokens [B, L], mask bool "
                              f"[B, L] and index int64 [B] (buckets.collate); got {got}.")
    rows = index >= 0
    if bool((index < -1).any()) or bool((rows & ~mask.any(1)).any()):
        bad = int(index[(index < -1) | (rows & ~mask.any(1))][0])
        raise PredictionError(f"batch {step}: row with index {bad} is not a sample (no real "
                              "token) nor a padding row (index -1).")
    return tokens, index, rows, mask


def pack_batch(batch: Any, step: int, batch_size: int | None) -> dict[str, torch.Tensor]:
    """Check one host batch ``(x, ..., index, mask)`` or ``{"tokens", "mask", "index"}``
    (``batch_size`` None: batch 0's); pack index and row mask as one int32 ``ids [B, 2]``
    (one gather; TPU collectives take int32)."""
    tokens_mask = None
    if isinstance(batch, dict):
        x, index, mask, tokens_mask = _unpack_dict(batch, step)
    elif not isinstance(batch, tuple | list) or len(batch) < 3:
        raise PredictionError(
            f"batch {step} is {_describe(batch)} without dataset indices: predict needs "
            "batches (x, ..., index, mask) (tpu_helpers.data.make_eval_loader) or dicts "
            "tokens, mask, index (tpu_helpers.buckets.collate).")
    else:
        x, index, mask = batch[0], batch[-2], batch[-1]
    if not (isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32)
            and index.dim() == 1 and isinstance(mask, torch.Tensor)
            and mask.dtype == torch.bool and mask.shape == index.shape):
        raise PredictionError(
            f"batch {step} ends with {_describe(index)} and {_describe(mask)}; expected the "
            "dataset index (int64 [B], -1 on padding) and the mask (bool [B], True = real).")
    inputs = list(x.values()) if isinstance(x, dict) else [x]
    if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() for t in inputs):
        raise PredictionError(f"batch {step}: the input is {_describe(x)}, not a tensor or a "
                              "dict of tensors with a batch axis.")
    rows = int(index.shape[0])
    batch_size = rows if batch_size is None else batch_size
    if rows != batch_size or any(t.shape[0] != rows for t in inputs):
        raise PredictionError(
            f"batch {step} has {rows} rows (dataset indices {index[mask][:4].tolist()}...), "
            f"batch 0 had {batch_size}: a partial batch compiles a second graph and hangs "
            "all_gather; pad and mask instead.")
    if rows and int(index.max()) >= 2**31 - 1:
        raise PredictionError(f"batch {step}: dataset index {int(index.max())} exceeds int32.")
    packed = {"x": x, "ids": pack_ids(index, mask)}
    return packed if tokens_mask is None else {**packed, "mask": tokens_mask}


class _CheckedBatches:
    """Host batches, checked and packed; ``error`` keeps what MpDeviceLoader's thread loses."""

    def __init__(self, loader, allow_empty: bool = False) -> None:
        self.loader, self.error = loader, None
        self.first_indices: dict[int, list[int]] = {}  # per step, for error messages
        batch = next(iter(loader), None)  # batch 0, checked in the calling thread
        if batch is None and allow_empty:  # gather=False: a rank with no rows (n < world)
            self.rows, self.x_dim = 0, 0
            return
        if batch is None:
            raise PredictionError("the loader yields no batches: nothing to predict.")
        x = pack_batch(batch, 0, None)["x"]  # a dict input: x_dim None (SpmdMesh refuses it)
        self.rows = int(next(iter(x.values())).shape[0] if isinstance(x, dict) else x.shape[0])
        self.x_dim = None if isinstance(x, dict) else x.dim()

    def __iter__(self):
        try:
            for step, batch in enumerate(self.loader):
                packed = pack_batch(batch, step, self.rows)
                ids = packed["ids"]
                self.first_indices[step] = ids[:, 0][ids[:, 1] != 0][:4].tolist()
                self.first_indices.pop(step - 256, None)  # MpDeviceLoader runs < 30 ahead
                yield packed
        except Exception as exc:
            self.error = exc

    def __len__(self) -> int:
        return len(self.loader)


@dataclass(frozen=True)
class PredictOptions:
    """The rarely changed knobs of :func:`predict`."""
    backend: Any = None  # e.g. TorchDistributedReplicas(); None: SpmdMesh or XlaReplicas
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # gathered bytes per transfer to the host
    all_ranks: bool = False  # return the result on every rank, not only the master
    gather: bool = True  # False: no collective, each rank gets its own rows (rank files)


class _OwnRows(list):
    """This rank's real rows only (``gather=False``): no [n, ...] array on every rank."""
    padding_rows = 0

    def add(self, index: np.ndarray, mask: np.ndarray, values: np.ndarray) -> None:
        self.append(exactly_once(index, mask, values, complete=False))
        self.padding_rows += int((~mask).sum())

    def result(self) -> Ordered:
        return exactly_once(np.concatenate([p.index for p in self]), None,
                            np.concatenate([p.values for p in self]))


def _collect(sink: OrderedBuffer | _OwnRows, parts) -> None:
    for out, ids in parts:
        out = out.float() if out.dtype == torch.bfloat16 else out  # numpy has no bfloat16
        sink.add(ids[:, 0].numpy(), ids[:, 1].numpy() != 0, out.numpy())


def _run(model, backend, batches: _CheckedBatches, sink, opts, keep: bool) -> None:
    """Forward and gather each step; every ``chunk_steps`` steps one transfer to the host."""
    pending, spec, chunk_steps, steps = [], None, 1, 0
    collective = opts.gather or backend.world_size == 1
    for step, batch in enumerate(backend.device_batches(batches, batches.x_dim)):
        tick(step, "predict")  # this batch is here: a replica stuck before it is named
        # Fetching this batch ran the previous step: a flush only copies.
        if len(pending) >= chunk_steps:
            _collect(sink, backend.to_host(pending))
            pending = []
        out = model(batch["x"], batch["mask"]) if "mask" in batch else model(batch["x"])
        # Checked at trace time, before the step's graph compiles.
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != batches.rows:
            raise PredictionError(
                f"the model returned {_describe(out)} at step {step} for a batch of "
                f"{batches.rows} rows; predict needs one tensor, one row per input row.")
        if spec is not None and (list(out.shape), out.dtype) != spec:
            raise PredictionError(
                f"the model output changed from {spec[0]} {spec[1]} at step 0 to "
                f"{list(out.shape)} {out.dtype} at step {step} (dataset indices "
                f"{batches.first_indices.get(step)}...): a new shape compiles another graph "
                "and hangs all_gather; return a fixed shape.")
        spec = (list(out.shape), out.dtype)
        if step == 0:
            row_bytes = out[0].nelement() * out.element_size() + 8
            step_rows = batches.rows * (backend.world_size if opts.gather else 1)
            chunk_steps = max(1, opts.chunk_bytes // (row_bytes * step_rows))
        # Every replica runs the same graph (SpmdMesh's world_size is 1: it only shards).
        moved = backend.gather_step(out, batch["ids"]) if collective else [out, batch["ids"]]
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
    """Run ``model`` (on the device, in eval mode, no grad) over this replica's ``loader``.

    Call it on every replica; ``n`` defaults to ``len(loader.dataset)``. Returns
    :class:`Predictions` on the master (every rank with ``all_ranks`` or ``gather=False``), else
    ``None``. Bad input raises :class:`PredictionError` naming the step, before a hang.
    """
    opts = options if options is not None else PredictOptions()
    backend = opts.backend or (SpmdMesh() if xr.is_spmd() else XlaReplicas())
    n = len(loader.dataset) if n is None and hasattr(loader, "dataset") else n
    if n is None:
        raise PredictionError("pass n, the dataset length: this loader has no .dataset.")
    batches = _CheckedBatches(loader, allow_empty=not opts.gather)
    if batches.rows == 0:  # no collective with gather=False: this rank has nothing to run
        return Predictions(np.zeros(0, np.int64), np.zeros(0, np.float32), 0, 0, 0, 0)
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
