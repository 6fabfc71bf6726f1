"""Where each shard of an SPMD tensor lives (``sharding_summary``: bytes per device from the
annotation, no copy) and sharded checkpoints saved atomically and loaded safely
(``save_sharded_checkpoint`` / ``load_sharded_checkpoint``, on one host or every host of a pod).
Taught in notebook 07: the summary from section 3, the placements in section 7's figures
(``course/plots.py``), the checkpoints in section 9. Moved here from the toolkit's
``tpu_helpers/spmd.py`` because only that notebook uses it (issue 28); the package ships it as
``course.sharding``. Of the repository it imports ``tpu_helpers.spmd`` (``sharding_spec``) and
``tpu_helpers.checkpoint`` (``fsync_folder``, the folder sync of ``atomic_write``);
importing it starts no XLA runtime (call the runtime functions after ``xr.use_spmd()``)."""

import contextlib
import dataclasses
import importlib
import itertools
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
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
import torch_xla
import torch_xla.runtime as xr
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

from tpu_helpers.checkpoint import fsync_folder
from tpu_helpers.spmd import sharding_spec


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """``tensor[index]`` lives on ``device``, which allocates ``padded_shape`` (padded)."""

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


def shard_placements(spec: str, shape: Sequence[int], num_devices: int) -> list[ShardPlacement]:
    """Which slice of a tensor of ``shape`` each device holds, ordered by device (pure).
    ``spec``: :func:`sharding_spec` of the tensor, tiled, replicated or ``""``."""
    shape = tuple(int(s) for s in shape)
    if spec in ("", "{replicated}"):
        return [ShardPlacement(d, tuple(slice(0, n) for n in shape), shape)
                for d in range(num_devices)]
    m = _TILED.match(spec)
    if not m:
        raise ValueError(f"sharding {spec!r} is not tiled or replicated")
    dims = [int(d) for d in m.group(1).split(",")]
    tile_dims = dims[:-1] if m.group(3) else dims
    if len(tile_dims) != len(shape):
        raise ValueError(f"sharding {spec!r} tiles {len(tile_dims)} dims of shape {shape}")
    iota = _IOTA.match(m.group(2))
    if iota:  # XLA's compact "iota" form: <=[4] or <=[2,2]T(1,0)
        base = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(math.prod(base)).reshape(base)
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
    else:
        ids = np.array([int(d) for d in m.group(2).split(",")])
    if ids.size != math.prod(dims):
        raise ValueError(f"sharding {spec!r}: {ids.size} device ids for tiles {dims}")
    tiles = ids.reshape(dims)
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
    return shard_placements(sharding_spec(t), t.shape, xr.global_runtime_device_count())


def sharding_summary(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> list[dict[str, Any]]:
    """A row per tensor (or parameter): ``copies`` (devices holding each element), ``bytes``,
    ``bytes/device`` (padded shard), ``fraction``; ``pd.DataFrame(rows)`` makes a table."""
    named = (tensors.named_parameters() if isinstance(tensors, torch.nn.Module)
             else tensors.items())
    rows = []
    for name, t in named:
        places = tensor_placements(t)
        total = t.numel() * t.element_size()
        per_device = max(math.prod(p.padded_shape) for p in places) * t.element_size()
        rows.append({"tensor": name, "shape": tuple(t.shape),
                     "dtype": str(t.dtype).removeprefix("torch."),
                     "sharding": sharding_spec(t) or "(none: replicated)",
                     "copies": len(places) // len({p.bounds for p in places}), "bytes": total,
                     "bytes/device": per_device, "fraction": per_device / total if total else 1.0})
    return rows


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide what ``dist_cp`` with torch_xla's planners warns on every call, all informational
    (single process, planner signature, two deprecations inside torch and torch_xla)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")
        warnings.filterwarnings("ignore", message=r"The function definition for SavePlanner")
        warnings.filterwarnings("ignore", message=r"TypedStorage is deprecated")
        warnings.filterwarnings("ignore", message=r"Using a non-tuple sequence for multidim")
        yield


def _all_hosts_ok(error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``what`` failed on any (none waits for the others forever): the
    own error, else (and for torch's ``CheckpointException``) a :class:`ShardedCheckpointError`."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    texts = [text]
    if dist.is_available() and dist.is_initialized():  # one process per host of a pod
        texts = [None] * dist.get_world_size()
        dist.all_gather_object(texts, text)
    if isinstance(error, dist_cp.CheckpointException):
        raise ShardedCheckpointError(f"{what} failed: {text}") from error
    if error is not None:
        raise error
    failed = {rank: t for rank, t in enumerate(texts) if t is not None}
    if failed:
        raise ShardedCheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {failed}")


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` onto ``final``; between the renames the old one is ``.<name>.old-<pid>``."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)  # a folder cannot be renamed over a full one
    os.replace(tmp, final)
    fsync_folder(final.parent)  # make the rename durable, as atomic_write does for a file
    shutil.rmtree(old, ignore_errors=True)


def xla_storage_writer(directory: str | os.PathLike[str]) -> dist_cp.FileSystemWriter:
    """``dist_cp.FileSystemWriter(directory, per_thread_copy_ahead=0)`` for XLA tensors, as
    torch_xla's ``CheckpointManager`` does (``distributed_checkpoint/manager.py``, v2.8.0/v2.9.0).
    With jax importable, ``xs.mark_sharding`` imports the wheel's ``torchax``, whose device module
    has no streams; the default writer's ``_OverlappingCpuLoader`` then fails (``'torchax.
    device_module' has no attribute 'current_stream'``: 2.8 with jax, Kaggle; 2.9 with jax and
    flax, Colab). ``per_thread_copy_ahead=0`` copies each tensor serially (``.cpu()``)."""
    return dist_cp.FileSystemWriter(directory, per_thread_copy_ahead=0)


def save_sharded_checkpoint(state_dict: Mapping[str, Any], directory: str | os.PathLike[str],
                            storage: str = "shared") -> Path:
    """``dist_cp.save`` (``SPMDSavePlanner``, no gather) into a temporary folder renamed onto
    ``directory``: a kill leaves the old checkpoint or the new one. On a pod call it on every
    host after ``dist.init_process_group("gloo", init_method="xla://")``; a failure on any host
    raises on all. ``storage="shared"``: every host writes into rank 0's folder; ``"local"``
    (each host its own disk): each host writes what it holds, loaded back there with the same
    mesh and sharding."""
    if storage not in ("shared", "local"):
        raise ValueError(f"storage must be 'shared' or 'local', not {storage!r}")
    final = Path(directory)
    # one folder, one coordinator (a process group: one process per host of a pod)
    together = dist.is_available() and dist.is_initialized() and storage == "shared"
    lead = not together or dist.get_rank() == 0  # makes the temp folder, renames it
    box = [None]
    if lead:
        final.parent.mkdir(parents=True, exist_ok=True)
        box = [tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent)]
    if together:  # rank 0's folder name on every rank
        dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    error = None
    try:
        with _quiet():
            dist_cp.save(state_dict=dict(state_dict), storage_writer=xla_storage_writer(tmp),
                         planner=SPMDSavePlanner(), no_dist=not together)
        if lead:
            _check_folder(tmp, _SafeReader(tmp).read_metadata(), shared=together)
    except BaseException as exc:
        error = exc
    try:
        _all_hosts_ok(error, f"saving {final}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # every host: the failed folder is not kept
        raise
    try:
        if lead:
            _swap_into_place(tmp, final)
    except BaseException as exc:
        error = exc
    _all_hosts_ok(error, f"renaming the saved checkpoint onto {final}")
    if not lead:  # a stray folder on a disk rank 0 does not see (nothing in it was needed)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class ShardedCheckpointError(RuntimeError):
    """A sharded checkpoint folder that cannot be loaded (or is refused), naming the file."""


class _MetadataUnpickler(pickle.Unpickler):
    """Only metadata classes, ``torch.Size``, dtypes, paths: a crafted ``.metadata`` runs no
    code (``dist_cp``'s plain ``pickle.load`` would)."""

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", n) for n in """Metadata MetadataIndex
          StorageMeta TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata
          TensorProperties _MEM_FORMAT_ENCODING""".split()),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        *(("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))}

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ShardedCheckpointError(
            f"{self.path}: refused: not a plain checkpoint metadata file, it asks to build "
            f"{module}.{name} (nothing from the file was run).")


class _SafeReader(dist_cp.FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` unpickles safely and refuses data files
    that are not plain names inside the folder (no ``../`` path traversal)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        rank = kwargs.get("rank")  # torch 2.9 may ask for a rank's own file
        path = folder / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                IndexError, KeyError, OSError) as exc:
            raise ShardedCheckpointError(f"{path}: corrupt or truncated checkpoint metadata "
                                         f"({type(exc).__name__}: {exc}).") from exc
        if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)):
            raise ShardedCheckpointError(f"{path}: not checkpoint metadata (found "
                                         f"{type(metadata).__name__}).")
        for info in (metadata.storage_data or {}).values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise ShardedCheckpointError(f"{path}: refused: names data file {name!r}, "
                                             f"which is not a file inside {folder}.")
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_folder(folder: Path, metadata: Metadata, shared: bool = False) -> None:
    """Every data file ``.metadata`` names is in ``folder``, else the first one missing."""
    names = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        why = ("the host that wrote it saved into a folder of that name on its own disk: the "
               "storage is not shared between hosts (use storage='local')" if shared else
               "a host's shards were not copied here, or were lost")
        raise ShardedCheckpointError(
            f"{folder / missing[0]}: missing, but {folder / '.metadata'} names it "
            f"({len(missing)} of {len(names)} data files missing): {why}.")


Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def _first_gap(box: Box, chunks: Sequence[Box]) -> tuple[int, ...] | None:
    """An index in ``box`` no chunk holds (None: covered): one corner per cell of the cuts."""
    cuts = [sorted({lo, hi, *(e for c in chunks for e in c[d] if lo < e < hi)})
            for d, (lo, hi) in enumerate(box)]
    for corner in itertools.product(*(c[:-1] for c in cuts)):
        if not any(all(lo <= x < hi for x, (lo, hi) in zip(corner, c, strict=True))
                   for c in chunks):
            return corner
    return None


def _local_shard_indices(t: torch.Tensor) -> list[Any]:
    """The index (slices, or ``...``) of each shard of ``t`` on this host's devices. Private
    torch_xla call on purpose: the public ``XLAShardedTensor(t).local_shards`` first copies every
    shard to the host (same call and result in torch_xla 2.8 and 2.9)."""
    (pairs,) = torch_xla._XLAC._get_local_shard_replica_and_indices([t])
    return [index for _, index in pairs]


def _needed(t: torch.Tensor) -> list[Box]:
    """What this host loads of ``t``: its own shards if ``t`` is sharded, else all of it."""
    whole = tuple((0, n) for n in t.shape)
    if not sharding_spec(t):
        return [whole]
    return [whole if index is Ellipsis else
            tuple((min(s.start, n), min(s.stop, n)) for s, n in zip(index, t.shape, strict=True))
            for index in _local_shard_indices(t)]


def _check_targets(folder: Path, metadata: Metadata, state_dict: Mapping[str, Any]) -> None:
    """Each tensor saved (KeyError), its shape (ValueError), each element this host loads."""
    saved = metadata.state_dict_metadata
    for key, value in ((k, v) for k, v in state_dict.items() if isinstance(v, torch.Tensor)):
        if key not in saved:
            raise KeyError(f"{folder}: checkpoint has no tensor {key!r} ({sorted(saved)[:8]}...)")
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(value.shape):
            raise ValueError(f"{folder}: {key!r} has shape {size} in the checkpoint but "
                             f"{tuple(value.shape)} in the model")
        chunks = [tuple((o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))
                  for c in getattr(saved[key], "chunks", [])]
        for box in _needed(value):
            gap = _first_gap(box, chunks)
            if gap is not None:
                raise ShardedCheckpointError(
                    f"{folder}: {key!r}: element {gap} is in none of its {len(chunks)} saved "
                    f"chunks {chunks[:4]}: this folder holds part of the tensor only (a "
                    "storage='local' checkpoint of another host, or another sharding).")


def _existing_folder(folder: Path) -> Path:
    """``folder``, or the old checkpoint a save killed between its two renames left."""
    if not folder.exists():
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
    """Load a :func:`save_sharded_checkpoint` folder into ``state_dict``'s tensors in place
    (shardings kept) and return it; on a pod call it on every host (a failure on one raises on
    all; each reads on its own, ``no_dist``). Checked first: ``.metadata`` (read safely), its
    data files, names and shapes (KeyError / ValueError), and that the saved chunks hold every
    element this host loads; else :class:`ShardedCheckpointError`."""
    error = None
    try:
        folder = _existing_folder(Path(directory))
        reader = _SafeReader(folder)
        metadata = reader.read_metadata()
        _check_folder(folder, metadata)
        _check_targets(folder, metadata, state_dict)
        with _quiet():
            dist_cp.load(state_dict=state_dict, storage_reader=reader, planner=SPMDLoadPlanner(),
                         no_dist=True)
    except BaseException as exc:
        error = exc
    _all_hosts_ok(error, f"loading {directory}")
    return state_dict
