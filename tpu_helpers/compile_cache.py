"""A persistent XLA compile cache in a folder that outlives the Colab / Kaggle session.

Taught in ``notebooks/03_multicore_training.ipynb``; ``python -m tpu_helpers.train``
enables it with ``--compile-cache auto``.

``xr.initialize_cache(path)`` makes XLA write every compiled program to ``path`` and look
there before compiling, so the second session skips the minutes of compiling a big model
needs on a TPU. The folder must survive the session: on Colab that is Google Drive
(``/content/drive/MyDrive/...``, after ``drive.mount``), on Kaggle ``/kaggle/working``
(kept when you save a version, or with the notebook's "persistence" setting), on a TPU VM
or your own machine ``~/.cache``. Entries are only valid for the same torch_xla release
and hardware, so the folder name carries both.

On XLA:CPU (torch_xla 2.9) the cache writes files but cannot read them back (counter
``PersistentCacheDeserializeFailure``): the speed-up shows only on a TPU. Whatever goes
wrong, a cache problem never stops a run: :func:`enable_compile_cache` warns and returns
``None``, and XLA compiles as usual.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tpu_helpers.env import TORCH_XLA_VERSION, Runtime, detect_runtime

#: Set it to force a cache folder (any platform).
CACHE_ENV = "TPU_NB_COMPILE_CACHE"
COLAB_DRIVE = Path("/content/drive/MyDrive")
KAGGLE_WORKING = Path("/kaggle/working")


@dataclass(frozen=True)
class CacheLocation:
    """Where the compile cache goes, whether it outlives the session, and why."""

    path: Path
    persistent: bool
    note: str


def compile_cache_dir(
    runtime: Runtime | None = None,
    environ: Mapping[str, str] | None = None,
    colab_drive: Path = COLAB_DRIVE,
    kaggle_working: Path = KAGGLE_WORKING,
    home: Path | None = None,
) -> CacheLocation:
    """Choose the compile cache folder for this runtime (see :func:`detect_runtime`).

    * ``$TPU_NB_COMPILE_CACHE`` if set;
    * Colab: ``MyDrive/tpu-notebooks/xla-cache/<tag>`` if Drive is mounted, otherwise
      ``/content/xla-cache/<tag>`` (lost with the session: mount Drive first);
    * Kaggle: ``/kaggle/working/xla-cache/<tag>``;
    * TPU VM / local: ``$XDG_CACHE_HOME`` or ``~/.cache``, ``tpu-notebooks/xla-cache/<tag>``.

    ``<tag>`` is ``torch_xla-2.9.0-<accelerator>`` (``cpu`` without a TPU). Reads the
    environment and the file system only.
    """
    env = os.environ if environ is None else environ
    rt = runtime or detect_runtime(env)
    hardware = rt.accelerator_type or rt.tpu_generation or "cpu"
    tag = f"torch_xla-{TORCH_XLA_VERSION}-{hardware}"
    if env.get(CACHE_ENV):
        return CacheLocation(Path(env[CACHE_ENV]).expanduser(), True, f"${CACHE_ENV}")
    if rt.platform == "colab":
        if colab_drive.is_dir():
            return CacheLocation(colab_drive / "tpu-notebooks" / "xla-cache" / tag, True,
                                 "Google Drive: survives the Colab session")
        return CacheLocation(Path("/content/xla-cache") / tag, False,
                             "Drive is not mounted: lost with the session "
                             "(from google.colab import drive; "
                             "drive.mount('/content/drive'))")
    if rt.platform == "kaggle":
        return CacheLocation(kaggle_working / "xla-cache" / tag, True,
                             "/kaggle/working: kept with a saved version or with persistence on")
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else (
        (home or Path.home()) / ".cache")
    return CacheLocation(base / "tpu-notebooks" / "xla-cache" / tag, True,
                         "local disk: survives restarts of this machine")


def enable_compile_cache(path: str | os.PathLike[str] | None = None, *,
                         replica: int | None = None, readonly: bool = False) -> Path | None:
    """``xr.initialize_cache`` on ``path`` (default :func:`compile_cache_dir`); never fatal.

    Call it in each process before its first computation: at the top of the function
    you pass to ``torch_xla.launch`` (with ``replica=xr.global_ordinal()``: each process
    gets its own sub-folder, as upstream's own multi-process test does), or before
    ``xr.use_spmd()`` work. Returns the folder in use, or ``None`` with a warning if the
    folder cannot be created or it is too late (something already compiled).
    """
    try:
        folder = Path(path) if path is not None else compile_cache_dir().path
        if replica is not None:
            folder = folder / f"replica-{replica}"
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK) and not readonly:
            raise PermissionError(f"{folder} is not writable")
        import torch_xla
        import torch_xla.runtime as xr

        if torch_xla._XLAC._xla_computation_cache_is_initialized():
            raise RuntimeError("something was already compiled in this process; enable the "
                               "cache before the first computation")
        xr.initialize_cache(str(folder), readonly=readonly)
    except Exception as exc:  # a cache is an optimisation, never a reason to stop
        warnings.warn(f"persistent compile cache not enabled ({type(exc).__name__}: {exc}); "
                      "continuing without it", RuntimeWarning, stacklevel=2)
        return None
    return folder


def cache_counters() -> dict[str, int]:
    """The persistent-cache counters of this process (hits, misses, failures)."""
    if "torch_xla" not in sys.modules:
        return {}
    import torch_xla.debug.metrics as met

    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()
            if n.startswith("PersistentCache")}
