"""Checkpoints that survive preemption: complete state, written atomically, loaded safely.

Taught in ``notebooks/03_multicore_training.ipynb``; needs no sibling (``train.py`` needs it).

* Complete (:func:`capture_training_state`): model and optimizer state, epoch, global step,
  batch position inside the epoch, and every RNG (torch CPU, numpy, Python ``random``, the
  XLA device RNG), so a resumed run continues bit for bit.
* Written by every replica, on disk by one (:func:`save_checkpoint`): global ordinal 0 for
  storage all hosts share, local ordinal 0 of each host for local disks
  (:func:`is_checkpoint_writer`); then a barrier, so nobody reads an unfinished file.
* Atomic (:func:`atomic_write`, the one way this package writes a file): a temp file in the
  same folder, ``fsync``, ``os.replace``: a kill leaves the old file or the new one.
* Loaded safely (:func:`load_checkpoint`): ``torch.load(weights_only=True)``, one clear error
  naming the file. :class:`CheckpointDir` keeps numbered step checkpoints and ``best.pt``.

Nothing here touches the XLA device at import time.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

#: Bumped when the layout of :func:`capture_training_state` changes.
FORMAT_VERSION = 1
#: Temp files are ``<name>.tmp-<pid>``: never a valid checkpoint name, cleaned up later.
TEMP_MARKER = ".tmp-"
STORAGE_KINDS = ("shared", "local")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded, explained in one sentence naming it."""


class UnsafeCheckpointError(CheckpointError):
    """A file refused because loading it would build objects or call functions (run code)."""


# --------------------------------------------------------------------------- who writes


def _xla_runtime_up() -> bool:
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def is_checkpoint_writer(storage: str = "shared") -> bool:
    """Whether this replica writes checkpoint files.

    ``storage="shared"``: the folder is the same for every host (NFS, a mounted bucket,
    or a single machine), so exactly one replica in the job writes: global ordinal 0
    (process 0 under SPMD, where each host runs one process whose device is ``xla:0``).
    ``storage="local"``: every host has its own disk, so one replica per host writes:
    local ordinal 0 (every SPMD process). Without an XLA runtime this process is the
    only one and writes.
    """
    if storage not in STORAGE_KINDS:
        raise ValueError(f"storage must be one of {STORAGE_KINDS}, got {storage!r}")
    if not _xla_runtime_up():
        return True
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return storage == "local" or xr.process_index() == 0
    if storage == "shared":
        return xr.global_ordinal() == 0
    return xr.local_ordinal() == 0


def replica_barrier(tag: str) -> None:
    """Wait until every replica got here (``xm.rendezvous``); a no-op with one replica."""
    if not _xla_runtime_up():
        return
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if xr.world_size() > 1:
        xm.rendezvous(tag)


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Every RNG a training run may draw from, in a form ``weights_only`` loading accepts.

    ``torch``: the CPU generator (DataLoader seeds, CPU dropout, init). ``numpy`` and
    ``python``: the global generators (if your augmentation uses them). ``xla``: the XLA
    device RNG (dropout on the device), ``None`` if this process has no XLA runtime.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002 (global RNG)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
        "xla": None,
    }
    if _xla_runtime_up():
        import torch_xla.core.xla_model as xm

        state["xla"] = int(xm.get_rng_state())
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` captured (the XLA part only if it was captured)."""
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np_state = (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                npst["has_gauss"], npst["cached_gaussian"])
    np.random.set_state(np_state)  # noqa: NPY002 (restores the global RNG)
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if state.get("xla") is not None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla"]))


# --------------------------------------------------------------------------- save / load


def _xla_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "xla":
            yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _xla_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _xla_tensors(v)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename inside ``folder`` durable (a preempted VM loses the page cache)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Write a file so that a crash or kill at any moment leaves the old file or the new one.

    ``write(f)`` writes the content to ``f``, a temp file opened ``"wb"`` in ``path``'s
    folder (``<name>.tmp-<pid>-<random>``); then the file is flushed and fsync'ed,
    moved onto ``path`` with ``os.replace``, and the folder fsync'ed. If ``write`` raises, the temp
    file is removed; after a SIGKILL it stays behind, never under ``path`` (ignored when
    loading, removed by :meth:`CheckpointDir.remove_stale_temp_files`). The one way this
    package writes a file: checkpoints, ``history.json``, prediction CSVs and shards.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}{TEMP_MARKER}{os.getpid()}-",
                               dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_atomically(path: str | os.PathLike[str], obj: Any) -> Path:
    """``torch.save(obj)`` to ``path`` through :func:`atomic_write`."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    is_writer: bool | None = None,
    barrier: Callable[[], None] | None = None,
    storage: str = "shared",
) -> Path | None:
    """Save ``state`` from a multi-replica run: call it on EVERY replica with the same state.

    The writer (default :func:`is_checkpoint_writer` for ``storage``) copies the tensors
    to the CPU and writes atomically (:func:`write_atomically`); then every replica waits
    at ``barrier`` (default: ``xm.rendezvous`` when there is more than one replica), so
    nobody reads a file that is not finished and nobody races ahead. Returns the path on
    the writer, ``None`` elsewhere. ``is_writer`` and ``barrier`` can be given
    explicitly for other process groups (e.g. ``torch.distributed`` with gloo).

    It does not call ``torch_xla.sync()``: :func:`capture_training_state` already did,
    on every replica, so copying is a pure transfer and the XLA RNG it recorded is not
    moved on by an extra sync (which would break bit-exact resumes).
    """
    writer = is_checkpoint_writer(storage) if is_writer is None else is_writer
    written = None
    if writer:
        written = write_atomically(path, _to_cpu(state))
    if barrier is None:
        replica_barrier(f"tpu_helpers.checkpoint:{Path(path).name}")
    else:
        barrier()
    return written


def _refusal(path: Path, exc: BaseException) -> CheckpointError | None:
    """An :class:`UnsafeCheckpointError` if ``torch.load`` refused the file's content."""
    found = re.search(r"GLOBAL (\S+)", str(exc))  # the class or function it would call
    if not (isinstance(exc, pickle.UnpicklingError) and found):
        return None
    return UnsafeCheckpointError(
        f"{path}: refused: not a plain checkpoint: it asks to build a "
        f"{found.group(1).rstrip('.,:')} object. Only tensors "
        "and plain containers are loaded (torch.load(weights_only=True)); nothing from the "
        "file was run. Load it only if you made it, and then not with this package.")


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint onto the CPU with ``torch.load(weights_only=True)``.

    Nothing in the file can run code. Raises :class:`UnsafeCheckpointError` naming the
    file if it holds anything but tensors and plain containers (a pickled object or
    function: it is refused, not run), and :class:`CheckpointError` naming the file if
    it is missing, truncated or corrupt, or not a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for damaged files
        refused = _refusal(path, exc)
        if refused is not None:
            raise refused from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint, not a complete "
                              f"torch.save file ({type(exc).__name__}: {first}).") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict, found {type(obj).__name__}.")
    return obj


# --------------------------------------------------------------------------- a folder


_STEP_NAME = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointDir:
    """A folder of ``step-00000042.pt`` checkpoints (the newest ``keep``) and ``best.pt``.

    >>> ckpts = CheckpointDir("runs/digits", keep=2)                 # doctest: +SKIP
    >>> ckpts.save(state, step=42)        # on every replica        # doctest: +SKIP
    >>> state, path = ckpts.load_latest()                            # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int | None = 2,
                 storage: str = "shared") -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        if storage not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {STORAGE_KINDS}, got {storage!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.storage = storage

    @property
    def best_path(self) -> Path:
        return self.directory / "best.pt"

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.pt"

    def steps(self) -> list[int]:
        """Steps with a finished checkpoint file, oldest first (temp files are ignored)."""
        if not self.directory.is_dir():
            return []
        found = (_STEP_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, state: Mapping[str, Any], step: int, *, is_writer: bool | None = None,
             barrier: Callable[[], None] | None = None) -> Path | None:
        """Save step ``step`` (call on every replica); the writer then prunes old ones."""
        writer = is_checkpoint_writer(self.storage) if is_writer is None else is_writer
        path = save_checkpoint(self.path_for(step), state, is_writer=writer, barrier=barrier)
        if writer:
            self.remove_stale_temp_files()
            if self.keep is not None:
                for old in self.steps()[:-self.keep]:
                    self.path_for(old).unlink(missing_ok=True)
        return path

    def save_best(self, state: Mapping[str, Any], *, is_writer: bool | None = None,
                  barrier: Callable[[], None] | None = None) -> Path | None:
        """Overwrite ``best.pt`` atomically. Decide "best" from a metric reduced across
        replicas, so every replica makes the same decision and calls this together."""
        writer = is_checkpoint_writer(self.storage) if is_writer is None else is_writer
        return save_checkpoint(self.best_path, state, is_writer=writer, barrier=barrier)

    def remove_stale_temp_files(self) -> list[Path]:
        """Delete temp files left by a writer that was killed mid-save (not our own)."""
        removed = []
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                if TEMP_MARKER in p.name and f"{TEMP_MARKER}{os.getpid()}-" not in p.name:
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    def load_latest(self) -> tuple[dict[str, Any] | None, Path | None]:
        """The newest step checkpoint that loads, and its path; ``(None, None)`` if none.

        A file that fails to load (e.g. damaged on disk) is reported with a warning and
        the next older one is tried. A refused file (:class:`UnsafeCheckpointError`:
        someone put a file here that would run code) is raised, not skipped: resuming
        quietly from an older checkpoint would change the run.
        """
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                return load_checkpoint(path), path
            except UnsafeCheckpointError:
                raise
            except CheckpointError as exc:
                warnings.warn(f"skipping unreadable checkpoint: {exc}", stacklevel=2)
        return None, None


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored run continues: start epoch ``epoch`` at batch ``batch_in_epoch``."""

    epoch: int
    batch_in_epoch: int
    step: int
    extra: dict[str, Any]


def capture_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    batch_in_epoch: int,
    step: int,
    sampler_epoch: int | None = None,
    host_rng: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything needed to resume, as one dict for :func:`save_checkpoint`.

    Call it on every replica. If the model lives on an XLA device it first runs
    ``torch_xla.sync()`` (pending work executes, step closures run, tensors become
    device data) and THEN records the XLA RNG: a resumed run sets that RNG and, like
    the original, syncs once (``MpDeviceLoader`` does) before tracing the next step, so
    dropout draws the same numbers.

    ``epoch``/``batch_in_epoch``: where the resumed run starts (the next batch to run).
    ``step``: optimizer steps done. ``sampler_epoch``: what to pass to
    ``sampler.set_epoch`` (defaults to ``epoch``). ``host_rng``: the torch/numpy/python
    RNG states to store instead of the current ones (when saving mid-epoch, the states
    from the start of the epoch, before the DataLoader drew its seed). ``extra``:
    tensors and plain values (history, best metric) returned in
    :attr:`ResumePoint.extra`.
    """
    if any(True for _ in _xla_tensors(dict(model.state_dict()))):
        import torch_xla

        torch_xla.sync()
    rng = rng_state()
    if host_rng is not None:
        rng.update({k: v for k, v in host_rng.items() if k != "xla"})
    return {
        "format": FORMAT_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": int(epoch),
        "batch_in_epoch": int(batch_in_epoch),
        "step": int(step),
        "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
        "rng": rng,
        "extra": dict(extra or {}),
    }


def restore_training_state(
    checkpoint: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    restore_rng: bool = True,
    source: str = "checkpoint",
) -> ResumePoint:
    """Load model/optimizer state (onto the model's device) and the RNGs; say where to go on.

    Call it after the model is on its device and the optimizer is built. Raises
    :class:`CheckpointError` naming ``source`` if the checkpoint is not one of ours.
    """
    missing = [k for k in ("format", "model", "optimizer", "epoch", "batch_in_epoch", "step",
                           "rng") if k not in checkpoint]
    if missing:
        raise CheckpointError(f"{source}: not a training checkpoint (missing {missing}).")
    if checkpoint["format"] != FORMAT_VERSION:
        raise CheckpointError(f"{source}: format {checkpoint['format']}, this code reads "
                              f"format {FORMAT_VERSION}.")
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{source}: does not fit this model/optimizer "
                              f"({str(exc).strip().splitlines()[0]}).") from exc
    if restore_rng:
        restore_rng_state(checkpoint["rng"])
    return ResumePoint(epoch=checkpoint["epoch"], batch_in_epoch=checkpoint["batch_in_epoch"],
                       step=checkpoint["step"], extra=dict(checkpoint.get("extra", {})))
