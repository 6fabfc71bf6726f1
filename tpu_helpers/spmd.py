"""SPMD model sharding: meshes for the devices you have, where each shard lives, and
sharded checkpoints.

Taught in ``notebooks/07_model_sharding_spmd.ipynb`` (tensor parallelism and FSDPv2 on 4
virtual XLA:CPU devices); ``notebooks/03`` and ``04`` use :func:`device_mesh` for SPMD data
parallelism and ``notebooks/08_myths_and_facts.ipynb`` uses :func:`sharding_summary` to
show that DDP keeps a full copy of the model on every device.

* :func:`mesh_shapes` / :func:`resolve_mesh_shape` (pure) and :func:`device_mesh`: a
  ``xs.Mesh`` over every device, with a clear error listing the shapes that fit.
* :func:`shard_placements` (pure: parses XLA's sharding string) and
  :func:`sharding_summary`: a pandas table with the bytes each device holds, computed from
  the shard shapes, without copying any data off the devices. :func:`plot_shard_layout`
  draws the same information.
* :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`:
  ``torch.distributed.checkpoint`` with torch_xla's SPMD planners, written atomically.

Call the runtime functions only after ``xr.use_spmd()``; importing this module touches
no device.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tpu_helpers.checkpoint import fsync_dir

# --------------------------------------------------------------------------- meshes


def mesh_shapes(num_devices: int, num_axes: int) -> list[tuple[int, ...]]:
    """Every mesh shape with ``num_axes`` axes whose sizes multiply to ``num_devices``.

    >>> mesh_shapes(4, 2)
    [(1, 4), (2, 2), (4, 1)]
    """
    if num_devices < 1 or num_axes < 1:
        raise ValueError(f"need num_devices >= 1 and num_axes >= 1, got {num_devices}, "
                         f"{num_axes}")
    if num_axes == 1:
        return [(num_devices,)]
    return [(d, *rest) for d in range(1, num_devices + 1) if num_devices % d == 0
            for rest in mesh_shapes(num_devices // d, num_axes - 1)]


def resolve_mesh_shape(num_devices: int, axis_names: Sequence[str],
                       shape: Sequence[int] | None = None) -> tuple[int, ...]:
    """Check a mesh shape against the device count (pure, no runtime).

    ``shape`` defaults to all devices on the first axis and 1 on the others; one ``-1``
    entry is inferred. Raises ValueError naming the shapes that would fit.
    """
    names = tuple(axis_names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"axis names must be distinct and non-empty, got {names}")
    if shape is None:
        return (num_devices,) + (1,) * (len(names) - 1)
    shape = tuple(int(s) for s in shape)
    fits = ", ".join(str(s) for s in mesh_shapes(num_devices, len(names)))
    hint = f"; shapes for {num_devices} devices and axes {names}: {fits}"
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but names {names}{hint}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: sizes must be >= 1 (at most one -1){hint}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if num_devices % known:
            raise ValueError(f"mesh shape {shape}: {num_devices} devices do not divide by "
                             f"{known}{hint}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices; "
                         f"{num_devices} are available{hint}")
    return shape


def device_mesh(axis_names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None):
    """A ``xs.Mesh`` over every device the SPMD runtime sees (all hosts of a pod slice).

    ``device_mesh(("data", "model"))`` on 4 devices is a (4, 1) mesh;
    ``device_mesh(("fsdp", "model"), (-1, 2))`` is (2, 2). Raises ValueError (before any
    compile) if the shape does not use exactly the available devices. For several slices
    joined by the data-centre network use ``xs.HybridMesh`` instead (notebook 07).
    """
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    shape = resolve_mesh_shape(n, axis_names, shape)
    return xs.Mesh(np.arange(n), shape, tuple(axis_names))


# --------------------------------------------------------------------------- shard layout


@dataclass(frozen=True)
class ShardPlacement:
    """One device's piece of a tensor: ``tensor[index]`` lives on device ``device``.

    ``index`` has one slice per dimension, into the global tensor, without padding;
    ``padded_shape`` is the buffer the device allocates (XLA pads uneven shards so every
    device holds the same shape).
    """

    device: int
    index: tuple[slice, ...]
    padded_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``index`` as ``(start, stop)`` pairs (hashable, unlike slices before 3.12)."""
        return tuple((s.start, s.stop) for s in self.index)


_TILED = re.compile(r"^\{devices=\[([\d,]+)\](.*?)( last_tile_dim_replicate)?\}$")
_IOTA = re.compile(r"^<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def _tile_devices(dims: list[int], devices: str, spec: str) -> np.ndarray:
    m = _IOTA.match(devices)
    if m:  # XLA's compact "iota" form: <=[4] or <=[2,2]T(1,0)
        base = [int(d) for d in m.group(1).split(",")]
        ids = np.arange(math.prod(base)).reshape(base)
        if m.group(2):
            ids = ids.transpose([int(p) for p in m.group(2).split(",")])
        ids = ids.reshape(-1)
    else:
        ids = np.array([int(d) for d in devices.split(",")])
    if ids.size != math.prod(dims):
        raise ValueError(f"sharding {spec!r}: {ids.size} device ids for tiles {dims}")
    return ids.reshape(dims)


def shard_placements(spec: str, shape: Sequence[int], num_devices: int) -> list[ShardPlacement]:
    """Which slice of a tensor of ``shape`` each device holds, from XLA's sharding string.

    ``spec`` is what ``torch_xla._XLAC._get_xla_sharding_spec(t)`` returns:
    ``"{devices=[4,1]0,1,2,3}"`` (tiled), ``"{devices=[2,1,2]0,2,1,3
    last_tile_dim_replicate}"`` (tiled, each tile on 2 devices), ``"{replicated}"``, or
    ``""`` (no annotation: under SPMD the tensor is replicated). Pure: no device access.
    Placements are ordered by device id.
    """
    shape = tuple(int(s) for s in shape)
    full = tuple(slice(0, n) for n in shape)
    if spec in ("", "{replicated}"):
        return [ShardPlacement(d, full, shape) for d in range(num_devices)]
    m = _TILED.match(spec)
    if not m:
        raise ValueError(f"sharding {spec!r} is not tiled or replicated; "
                         "shard_placements does not handle it")
    dims = [int(d) for d in m.group(1).split(",")]
    replicate = m.group(3) is not None
    tile_dims = dims[:-1] if replicate else dims
    if len(tile_dims) != len(shape):
        raise ValueError(f"sharding {spec!r} tiles {len(tile_dims)} dims but the tensor has "
                         f"shape {shape}")
    tiles = _tile_devices(dims, m.group(2), spec)
    padded = tuple(-(-n // t) for n, t in zip(shape, tile_dims, strict=True))
    out = []
    for tile in np.ndindex(*tile_dims):
        index = tuple(slice(min(i * p, n), min((i + 1) * p, n))
                      for i, p, n in zip(tile, padded, shape, strict=True))
        for dev in np.atleast_1d(tiles[tile]).reshape(-1):
            out.append(ShardPlacement(int(dev), index, padded))
    if sorted(p.device for p in out) != list(range(len(out))):
        raise ValueError(f"sharding {spec!r} does not place each of {len(out)} devices once")
    if len(out) != num_devices:
        raise ValueError(f"sharding {spec!r} uses {len(out)} devices, not {num_devices}")
    return sorted(out, key=lambda p: p.device)


def _named_tensors(tensors: Mapping[str, torch.Tensor] | torch.nn.Module
                   ) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tensors, torch.nn.Module):
        return list(tensors.named_parameters())
    return list(tensors.items())


def sharding_summary(tensors: Mapping[str, torch.Tensor] | torch.nn.Module):
    """One row per tensor (a module's parameters, or a name -> tensor mapping).

    Columns: ``shape``, ``dtype``, ``sharding`` (XLA's string), ``copies`` (how many
    devices hold each element), ``bytes`` (the whole tensor) and ``bytes/device`` (the
    padded shard every device allocates), ``fraction`` (= bytes/device / bytes).
    Computed from the shard shapes; no data leaves the devices. The column sums give the
    per-device total: ``df["bytes/device"].sum() / df["bytes"].sum()``.
    """
    import pandas as pd
    import torch_xla
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    rows = []
    for name, t in _named_tensors(tensors):
        spec = torch_xla._XLAC._get_xla_sharding_spec(t) if t.device.type == "xla" else ""
        places = shard_placements(spec, t.shape, n)
        item = t.element_size()
        copies = len(places) // len({p.bounds for p in places})
        rows.append({"tensor": name, "shape": tuple(t.shape), "dtype": str(t.dtype)
                     .removeprefix("torch."), "sharding": spec or "(none: replicated)",
                     "copies": copies, "bytes": t.numel() * item,
                     "bytes/device": max(math.prod(p.padded_shape) for p in places) * item})
    df = pd.DataFrame(rows).set_index("tensor")
    df["fraction"] = df["bytes/device"] / df["bytes"]
    return df


# --------------------------------------------------------------------------- checkpoints

#: torch's single-process notice and its planner-signature nag (torch_xla's planners
#: predate the ``storage_meta`` argument): both informational, filtered here.
_CHECKPOINT_NOISE = (r"torch\.distributed is disabled, unavailable or uninitialized",
                     r"The function definition for SavePlanner\.set_up_planner")


def save_sharded_checkpoint(state_dict: Mapping[str, Any], directory: str | os.PathLike[str]
                            ) -> Path:
    """Save a (sharded) state dict with ``torch.distributed.checkpoint`` and torch_xla's
    ``SPMDSavePlanner``: each device's shards are written without gathering the tensor.

    Written to a temporary folder next to ``directory`` (files fsync'ed by
    ``FileSystemWriter``), then renamed onto it, so a kill leaves the old checkpoint or
    the new one, never a mix (between the two renames the old one is
    ``.<name>.old-<pid>``, which :func:`load_sharded_checkpoint` falls back to). Works in
    one process without a process group (SPMD); on a multi-host pod every host calls it
    with shared storage.
    """
    import torch.distributed.checkpoint as dist_cp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        with warnings.catch_warnings():
            for msg in _CHECKPOINT_NOISE:
                warnings.filterwarnings("ignore", message=msg)
            dist_cp.save(state_dict=dict(state_dict), storage_writer=dist_cp.FileSystemWriter(tmp),
                         planner=SPMDSavePlanner())
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)  # a folder cannot be renamed over a full one
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.distributed.checkpoint`` ``.metadata`` file, refusing any class
    or function but the checkpoint metadata dataclasses, ``torch.Size``, dtypes and
    paths: a crafted file cannot call ``os.system`` (plain ``pickle.load`` would)."""

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        if (module, name) in self._ALLOWED:
            return getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A class or function :class:`_MetadataUnpickler` does not allow."""


def _safe_reader(folder: Path):
    """A ``FileSystemReader`` whose ``read_metadata`` uses :class:`_MetadataUnpickler` and
    checks the result, so nothing in the folder can run code when it is loaded."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeFileSystemReader(dist_cp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")  # torch 2.9 may ask for a rank's own file
            path = folder / (".metadata" if rank is None else f"__{rank}.metadata")
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f, path).load()
            except _Refused as exc:
                raise ShardedCheckpointError(
                    f"{path}: refused: not a plain checkpoint metadata file, it asks to "
                    f"build {exc} (only the checkpoint's own metadata classes are "
                    "allowed; nothing from the file was run).") from None
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                    IndexError, KeyError, OSError) as exc:
                raise ShardedCheckpointError(f"{path}: corrupt or truncated checkpoint "
                                             f"metadata ({type(exc).__name__}: {exc}).") from exc
            _check_metadata(metadata, path, folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(folder)


def _check_metadata(metadata: Any, path: Path, folder: Path) -> None:
    """The metadata is a ``Metadata`` whose data files are plain names in ``folder``."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ShardedCheckpointError(f"{path}: not checkpoint metadata (found "
                                     f"{type(metadata).__name__}).")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ShardedCheckpointError(f"{path}: refused: names data file {name!r}, "
                                         f"which is not a file inside {folder}.")


class ShardedCheckpointError(RuntimeError):
    """A sharded checkpoint folder that cannot be loaded (or is refused), naming the file."""


def load_sharded_checkpoint(state_dict: Mapping[str, Any], directory: str | os.PathLike[str]
                            ) -> Mapping[str, Any]:
    """Load a checkpoint written by :func:`save_sharded_checkpoint` into ``state_dict``,
    in place: each device reads only its own shards, the shardings are kept.

    Nothing in the folder can run code: ``.metadata`` (which ``torch.distributed.checkpoint``
    would unpickle with plain ``pickle``) is read by a restricted unpickler that allows
    only the checkpoint's metadata classes, and the tensors with ``weights_only`` loading.
    Checks first, on the host, that the folder is a checkpoint and that every tensor in
    ``state_dict`` is in it with the same shape (a clear error naming the folder and the
    key otherwise). Returns ``state_dict``.
    """
    import torch.distributed.checkpoint as dist_cp
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    folder = Path(directory)
    if not folder.exists():  # killed between save_sharded_checkpoint's two renames?
        previous = sorted(folder.parent.glob(f".{folder.name}.old-*"))
        if previous:
            warnings.warn(f"{folder} is missing; loading {previous[-1].name}, the checkpoint "
                          "it replaced when a save was interrupted.", stacklevel=2)
            folder = previous[-1]
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder}: not a sharded checkpoint (no .metadata file)")
    reader = _safe_reader(folder)
    saved = reader.read_metadata().state_dict_metadata
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in saved:
            raise KeyError(f"{folder}: checkpoint has no tensor {key!r} "
                           f"(it has {sorted(saved)[:8]}...)")
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(value.shape):
            raise ValueError(f"{folder}: {key!r} has shape {size} in the checkpoint but "
                             f"{tuple(value.shape)} in the model")
    with warnings.catch_warnings():
        for msg in _CHECKPOINT_NOISE:
            warnings.filterwarnings("ignore", message=msg)
        dist_cp.load(state_dict=state_dict, storage_reader=reader, planner=SPMDLoadPlanner())
    return state_dict
