"""Checkpoints that survive preemption: complete state, written atomically, loaded safely.

Taught in notebook 03 (``train.py`` resumes with it). Needs no sibling; importing it does not
touch the XLA device. A resume from :func:`capture_training_state` is bit for bit (every RNG).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

FORMAT_VERSION = 1  # bumped when the layout of capture_training_state changes
#: Temp files are ``<name>.tmp-<pid>-<random>``: never a checkpoint name, cleaned up later.
TEMP_MARKER = ".tmp-"
STORAGE_KINDS = ("shared", "local")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file."""


class UnsafeCheckpointError(CheckpointError):
    """A file refused because loading it would build objects or call functions."""


def _xla_runtime_up() -> bool:
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def is_checkpoint_writer(storage: str = "shared") -> bool:
    """Whether this replica writes checkpoint files (always, without an XLA runtime).

    ``storage="shared"`` (one folder for every host): global ordinal 0 (SPMD: process 0).
    ``storage="local"`` (each host its own disk): local ordinal 0 (SPMD: every process).
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


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from (``xla``: ``None`` without a runtime), ``weights_only``-safe."""
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


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Write ``path`` so that a kill at any moment leaves the old file or the new one.

    ``write(f)`` fills a temp file in the same folder; it is fsync'ed, moved onto ``path`` with
    ``os.replace``, and the folder fsync'ed (a preempted VM loses the page cache). After a
    SIGKILL the temp file stays, never under ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}{TEMP_MARKER}{os.getpid()}-", dir=path.parent)
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
    fsync_folder(path.parent)
    return path


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make the renames in ``folder`` durable (some file systems cannot fsync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_atomically(path: str | os.PathLike[str], obj: Any) -> Path:
    """``torch.save(obj)`` to ``path`` through :func:`atomic_write`."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                    is_writer: bool | None = None, barrier: Callable[[], None] | None = None,
                    storage: str = "shared") -> Path | None:
    """Save ``state``: call on EVERY replica; returns the path on the writer, else ``None``.

    The writer (default :func:`is_checkpoint_writer`) writes a CPU copy atomically, then all
    wait at ``barrier`` (default ``xm.rendezvous``). No ``torch_xla.sync()``: it would move the
    XLA RNG that :func:`capture_training_state` recorded."""
    writer = is_checkpoint_writer(storage) if is_writer is None else is_writer
    written = write_atomically(path, _to_cpu(state)) if writer else None
    if barrier is not None:
        barrier()
    elif _xla_runtime_up():
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.world_size() > 1:
            xm.rendezvous(f"tpu_helpers.checkpoint:{Path(path).name}")
    return written


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint dict onto the CPU with ``torch.load(weights_only=True)``: anything but
    tensors and plain containers is :class:`UnsafeCheckpointError` (nothing is run); a missing,
    damaged or non-dict file is :class:`CheckpointError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for damaged files
        found = re.search(r"GLOBAL (\S+)", str(exc))  # the class or function it would call
        if isinstance(exc, pickle.UnpicklingError) and found:
            raise UnsafeCheckpointError(
                f"{path}: refused: not a plain checkpoint: it asks to build a "
                f"{found.group(1).rstrip('.,:')} object. Only tensors and plain containers are "
                "loaded (torch.load(weights_only=True)); nothing from the file was run.") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint, not a complete "
                              f"torch.save file ({type(exc).__name__}: {first}).") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict, found {type(obj).__name__}.")
    return obj


_STEP_NAME = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointDir:
    """A folder of ``step-00000042.pt`` checkpoints (the newest ``keep``) and ``best.pt``."""

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
        """Save step ``step`` (call on every replica); the writer then deletes the temp files
        of a writer killed mid-save (not its own) and prunes old steps."""
        writer = is_checkpoint_writer(self.storage) if is_writer is None else is_writer
        path = save_checkpoint(self.path_for(step), state, is_writer=writer, barrier=barrier)
        if writer:
            for p in self.directory.glob(f"*{TEMP_MARKER}*"):  # left by a writer killed mid-save
                if f"{TEMP_MARKER}{os.getpid()}-" not in p.name:
                    p.unlink(missing_ok=True)
            if self.keep is not None:
                for old in self.steps()[:-self.keep]:
                    self.path_for(old).unlink(missing_ok=True)
        return path

    def save_best(self, state: Mapping[str, Any], *, is_writer: bool | None = None,
                  barrier: Callable[[], None] | None = None) -> Path | None:
        """Overwrite ``best.pt`` (every replica calls it, deciding from a reduced metric)."""
        writer = is_checkpoint_writer(self.storage) if is_writer is None else is_writer
        return save_checkpoint(self.best_path, state, is_writer=writer, barrier=barrier)

    def load_latest(self) -> tuple[dict[str, Any] | None, Path | None]:
        """The newest step checkpoint that loads, and its path; ``(None, None)`` if none. A
        damaged file is skipped with a warning; a refused (unsafe) one raises."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                return load_checkpoint(path), path
            except UnsafeCheckpointError:
                raise
            except CheckpointError as exc:
                warnings.warn(f"skipping unreadable checkpoint: {exc}", stacklevel=2)
        return None, None


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored run continues: start epoch ``epoch`` at batch ``batch_in_epoch``."""

    epoch: int
    batch_in_epoch: int
    step: int
    extra: dict[str, Any]


def capture_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           epoch: int, batch_in_epoch: int, step: int,
                           extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything needed to resume, as one dict for :func:`save_checkpoint` (every replica).

    On an XLA model it runs ``torch_xla.sync()`` and THEN records the XLA RNG, so the resumed
    run's dropout draws the same. ``epoch``/``batch_in_epoch``: the next batch to run; ``step``:
    optimizer steps done; ``extra``: plain values returned in :attr:`ResumePoint.extra`.
    """
    if any(isinstance(t, torch.Tensor) and t.device.type == "xla"
           for t in model.state_dict().values()):
        import torch_xla

        torch_xla.sync()
    return {"format": FORMAT_VERSION, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "epoch": int(epoch),
            "batch_in_epoch": int(batch_in_epoch), "step": int(step), "rng": rng_state(),
            "extra": dict(extra or {})}


def restore_training_state(checkpoint: Mapping[str, Any], model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer, *,
                           source: str = "checkpoint") -> ResumePoint:
    """Load model/optimizer state and the RNGs; :class:`CheckpointError` names ``source``."""
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
    restore_rng_state(checkpoint["rng"])
    return ResumePoint(epoch=checkpoint["epoch"], batch_in_epoch=checkpoint["batch_in_epoch"],
                       step=checkpoint["step"], extra=dict(checkpoint.get("extra", {})))
