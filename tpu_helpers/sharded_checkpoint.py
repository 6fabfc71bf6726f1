"""Sharded checkpoints of an SPMD model, saved atomically and loaded without running code:
:func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`, on one host or on every host
of a pod (``storage="shared"``: one folder all hosts see; ``"local"``: each host's own disk).

``torch.distributed.checkpoint`` (``dist_cp``) with torch_xla's SPMD planners writes each
device's shards (no gather) and reads them back into the state dict's own tensors, shardings
kept. This unit adds: a temporary folder renamed into place (a kill leaves the old checkpoint
or the new one), a failure on any host raised on every host, the ``.metadata`` file read by a
restricted unpickler (``dist_cp``'s plain ``pickle.load`` would run a crafted file's code),
and, before any tensor is read, the data files, names, shapes and saved chunks checked
(:class:`ShardedCheckpointError` names the file); :func:`xla_storage_writer` is the writer
setting ``dist_cp`` needs where jax is installed (Colab, Kaggle). Taught in notebook 07,
section 9. Copy it with ``checkpoint.py`` (``fsync_folder``, the folder sync of its
``atomic_write``). Importing it starts no XLA runtime (save and load after ``xr.use_spmd()``).
"""

import contextlib
import importlib
import itertools
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
import torch_xla
import torch_xla.distributed.spmd as xs
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

try:  # inside the tpu_helpers package
    from .checkpoint import fsync_folder
except ImportError:  # copied next to checkpoint.py into your project
    from checkpoint import fsync_folder  # type: ignore[no-redef]


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


def _annotated(t: torch.Tensor) -> bool:
    """``t`` has a sharding annotation (``spmd.sharding_spec(t) != ""``, without that sibling)."""
    return t.device.type == "xla" and bool(xs.XLAShardedTensor(t).sharding_spec)


def _needed(t: torch.Tensor) -> list[Box]:
    """What this host loads of ``t``: its own shards if ``t`` is sharded, else all of it."""
    whole = tuple((0, n) for n in t.shape)
    if not _annotated(t):
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
