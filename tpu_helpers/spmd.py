"""SPMD model sharding: a mesh over the devices you have, where each shard lives, and
sharded checkpoints that save atomically and load safely.

Taught in ``notebooks/07_model_sharding_spmd.ipynb`` (the mesh, ``xs.mark_sharding``, FSDPv2
and ``torch.distributed.checkpoint`` are written in its cells first); notebooks 03 and 04
use :func:`device_mesh`. Copy this file alone: torch, torch_xla, numpy and the standard
library, no sibling. Importing it (and torch_xla) does not start the XLA runtime; call the
runtime functions after ``xr.use_spmd()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dist_cp
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

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
    """Check a mesh shape against the device count (pure): default all devices on the
    first axis, one ``-1`` inferred; the ValueError lists the shapes that fit."""
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


def device_mesh(axis_names: tuple[str, ...] = ("data",),
                shape: tuple[int, ...] | None = None) -> xs.Mesh:
    """``xs.Mesh(np.arange(n), shape, axis_names)`` over all ``n`` devices the SPMD runtime
    sees (every host of a pod slice), refusing a shape that does not use exactly them.

    ``device_mesh(("data", "model"))`` on 4 devices is (4, 1); ``device_mesh(("fsdp",
    "model"), (-1, 2))`` is (2, 2). Several slices joined by DCN: ``xs.HybridMesh``.
    """
    n = xr.global_runtime_device_count()
    shape = resolve_mesh_shape(n, axis_names, shape)
    return xs.Mesh(np.arange(n), shape, tuple(axis_names))


# --------------------------------------------------------------------------- shard layout


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """``tensor[index]`` lives on ``device``; the device allocates ``padded_shape`` (XLA
    pads uneven shards so every device holds the same shape)."""

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
    """Which slice of a tensor of ``shape`` each device holds, ordered by device (pure).

    ``spec`` is ``torch_xla._XLAC._get_xla_sharding_spec(t)``: ``"{devices=[4,1]0,1,2,3}"``,
    ``"{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"`` (each tile on 2 devices),
    ``"{replicated}"`` or ``""`` (not annotated: replicated under SPMD).
    """
    shape = tuple(int(s) for s in shape)
    if spec in ("", "{replicated}"):
        return [ShardPlacement(d, tuple(slice(0, n) for n in shape), shape)
                for d in range(num_devices)]
    m = _TILED.match(spec)
    if not m:
        raise ValueError(f"sharding {spec!r} is not tiled or replicated; "
                         "shard_placements does not handle it")
    dims = [int(d) for d in m.group(1).split(",")]
    tile_dims = dims[:-1] if m.group(3) else dims
    if len(tile_dims) != len(shape):
        raise ValueError(f"sharding {spec!r} tiles {len(tile_dims)} dims but the tensor has "
                         f"shape {shape}")
    tiles = _tile_devices(dims, m.group(2), spec)
    padded = tuple(-(-n // t) for n, t in zip(shape, tile_dims, strict=True))
    out = []
    for tile in np.ndindex(*tile_dims):
        index = tuple(slice(min(i * p, n), min((i + 1) * p, n))
                      for i, p, n in zip(tile, padded, shape, strict=True))
        out += [ShardPlacement(int(d), index, padded) for d in np.ravel(tiles[tile])]
    if sorted(p.device for p in out) != list(range(len(out))):
        raise ValueError(f"sharding {spec!r} does not place each of {len(out)} devices once")
    if len(out) != num_devices:
        raise ValueError(f"sharding {spec!r} uses {len(out)} devices, not {num_devices}")
    return sorted(out, key=lambda p: p.device)


def tensor_placements(t: torch.Tensor) -> list[ShardPlacement]:
    """:func:`shard_placements` of a tensor, from its sharding annotation (no data moves)."""
    spec = torch_xla._XLAC._get_xla_sharding_spec(t) if t.device.type == "xla" else ""
    return shard_placements(spec, t.shape, xr.global_runtime_device_count())


def sharding_summary(tensors: Mapping[str, torch.Tensor] | torch.nn.Module
                     ) -> list[dict[str, Any]]:
    """One row (a dict) per tensor of a mapping, or per parameter of a module.

    ``copies``: how many devices hold each element; ``bytes``: the whole tensor;
    ``bytes/device``: the padded shard each device allocates; ``fraction`` = the ratio.
    ``pd.DataFrame(rows).set_index("tensor")`` makes it a table.
    """
    named = (tensors.named_parameters() if isinstance(tensors, torch.nn.Module)
             else tensors.items())
    rows = []
    for name, t in named:
        places = tensor_placements(t)
        spec = torch_xla._XLAC._get_xla_sharding_spec(t) if t.device.type == "xla" else ""
        total = t.numel() * t.element_size()
        per_device = max(math.prod(p.padded_shape) for p in places) * t.element_size()
        rows.append({"tensor": name, "shape": tuple(t.shape),
                     "dtype": str(t.dtype).removeprefix("torch."),
                     "sharding": spec or "(none: replicated)",
                     "copies": len(places) // len({p.bounds for p in places}),
                     "bytes": total, "bytes/device": per_device,
                     "fraction": per_device / total if total else 1.0})
    return rows


# --------------------------------------------------------------------------- checkpoints

#: torch's single-process notice and its planner-signature nag (torch_xla's planners
#: predate the ``storage_meta`` argument): both informational.
_CHECKPOINT_NOISE = (r"torch\.distributed is disabled, unavailable or uninitialized",
                     r"The function definition for SavePlanner\.set_up_planner")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        for msg in _CHECKPOINT_NOISE:
            warnings.filterwarnings("ignore", message=msg)
        yield


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_sharded_checkpoint(state_dict: Mapping[str, Any], directory: str | os.PathLike[str]
                            ) -> Path:
    """``dist_cp.save`` with ``SPMDSavePlanner`` (each device's shards written without
    gathering), into a temporary folder renamed onto ``directory``: a kill leaves the old
    checkpoint or the new one (between the two renames the old one is
    ``.<name>.old-<pid>``, which :func:`load_sharded_checkpoint` falls back to).

    One process needs no process group (SPMD on one host). On several hosts every host
    calls it, on shared storage, after ``dist.init_process_group("gloo",
    init_method="xla://")``: without a group each host would write as rank 0.
    """
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        with _quiet():
            dist_cp.save(state_dict=dict(state_dict), storage_writer=dist_cp.FileSystemWriter(tmp),
                         planner=SPMDSavePlanner())
        old = final.with_name(f".{final.name}.old-{os.getpid()}") if final.exists() else None
        if old is not None:
            os.replace(final, old)  # a folder cannot be renamed over a full one
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class ShardedCheckpointError(RuntimeError):
    """A sharded checkpoint folder that cannot be loaded (or is refused), naming the file."""


class _Refused(pickle.UnpicklingError):
    """A class or function :class:`_MetadataUnpickler` does not allow."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``.metadata`` allowing only the checkpoint metadata dataclasses,
    ``torch.Size``, dtypes and paths: a crafted file cannot call ``os.system`` (plain
    ``pickle.load``, which ``torch.distributed.checkpoint`` uses, would)."""

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath",
                                         "PureWindowsPath")),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def _read_metadata(path: Path, folder: Path) -> Metadata:
    """``path`` unpickled safely, then checked: a ``Metadata`` whose data files are plain
    names inside ``folder`` (no ``../`` path traversal)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise ShardedCheckpointError(
            f"{path}: refused: not a plain checkpoint metadata file, it asks to build {exc} "
            "(only the checkpoint's own metadata classes are allowed; nothing from the "
            "file was run).") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, OSError) as exc:
        raise ShardedCheckpointError(f"{path}: corrupt or truncated checkpoint metadata "
                                     f"({type(exc).__name__}: {exc}).") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ShardedCheckpointError(f"{path}: not checkpoint metadata (found "
                                     f"{type(metadata).__name__}).")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ShardedCheckpointError(f"{path}: refused: names data file {name!r}, "
                                         f"which is not a file inside {folder}.")
    return metadata


class _SafeReader(dist_cp.FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` is :func:`_read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        rank = kwargs.get("rank")  # torch 2.9 may ask for a rank's own file
        metadata = _read_metadata(folder / (".metadata" if rank is None
                                            else f"__{rank}.metadata"), folder)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_safe_reader = _SafeReader


def _checkpoint_folder(directory: str | os.PathLike[str]) -> Path:
    folder = Path(directory)
    if not folder.exists():  # killed between save_sharded_checkpoint's two renames?
        previous = sorted(folder.parent.glob(f".{folder.name}.old-*"))
        if previous:
            warnings.warn(f"{folder} is missing; loading {previous[-1].name}, the checkpoint "
                          "it replaced when a save was interrupted.", stacklevel=3)
            folder = previous[-1]
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder}: not a sharded checkpoint (no .metadata file)")
    return folder


def load_sharded_checkpoint(state_dict: Mapping[str, Any], directory: str | os.PathLike[str]
                            ) -> Mapping[str, Any]:
    """Load a :func:`save_sharded_checkpoint` folder into ``state_dict`` in place (the
    model's own tensors: no ``load_state_dict`` needed); each device reads its own shards
    and the shardings are kept. Nothing in the folder can run code (see
    :class:`_MetadataUnpickler`). Names and shapes are checked on the host first; the
    error names the folder and the key. Returns ``state_dict``."""
    folder = _checkpoint_folder(directory)
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
    with _quiet():
        dist_cp.load(state_dict=state_dict, storage_reader=reader, planner=SPMDLoadPlanner())
    return state_dict
