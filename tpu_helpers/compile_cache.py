"""A persistent XLA compile cache in a folder that outlives the Colab / Kaggle session.

Taught in ``notebooks/05_performance_debugging.ipynb`` (what the cache does on XLA:CPU and
on a TPU) and ``notebooks/03_multicore_training.ipynb`` (where the folder goes on Colab /
Kaggle); ``python -m tpu_helpers.train`` enables it with ``--compile-cache auto``. Needs no
sibling: copy this file alone (standard library, torch_xla).

``xr.initialize_cache(path)`` makes XLA write every compiled program to ``path`` and look
there before compiling, so the second session skips the minutes of compiling a big model
needs on a TPU. The folder must survive the session: on Colab that is Google Drive
(``/content/drive/MyDrive/...``, after ``drive.mount``), on Kaggle ``/kaggle/working``
(kept when you save a version, or with the notebook's "persistence" setting), on a TPU VM
or your own machine ``~/.cache``. Entries are only valid for the same torch_xla release
and hardware, so the folder name carries both.

On XLA:CPU (torch_xla 2.8 and 2.9) the cache writes files but cannot read them back
(counter ``PersistentCacheDeserializeFailure``): the speed-up shows only on a TPU. Whatever goes
wrong, a cache problem never stops a run: :func:`enable_compile_cache` warns and returns
``None``, and XLA compiles as usual.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Set it to force a cache folder (any platform).
CACHE_ENV = "TPU_NB_COMPILE_CACHE"
COLAB_DRIVE = Path("/content/drive/MyDrive")
KAGGLE_WORKING = Path("/kaggle/working")
_GOOGLE_PCI_VENDOR = "0x1ae0"
#: PCI device id -> TPU generation (as in torch_xla/_internal/tpu.py).
_PCI_GENERATION = {"0x0027": "v3", "0x005e": "v4", "0x0063": "v5e", "0x0062": "v5p",
                   "0x006f": "v6e"}


def _torch_xla_version() -> str:
    try:
        return md.version("torch_xla").split("+")[0]
    except md.PackageNotFoundError:
        return "unknown"


def _platform(env: Mapping[str, str], kaggle_dir: Path = Path("/kaggle")) -> str:
    if "COLAB_RELEASE_TAG" in env or "COLAB_BACKEND_VERSION" in env:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env or kaggle_dir.is_dir():
        return "kaggle"
    return "local"


def _hardware(env: Mapping[str, str], pci_root: Path = Path("/sys/bus/pci/devices")) -> str:
    """``TPU_ACCELERATOR_TYPE``, else the TPU generation read from sysfs, else ``cpu``."""
    if env.get("TPU_ACCELERATOR_TYPE"):
        return env["TPU_ACCELERATOR_TYPE"]
    for vendor in pci_root.glob("*/vendor"):
        try:
            if vendor.read_text().strip() == _GOOGLE_PCI_VENDOR:
                device = (vendor.parent / "device").read_text().strip()
                if device in _PCI_GENERATION:
                    return _PCI_GENERATION[device]
        except OSError:
            continue
    return "cpu"


@dataclass(frozen=True)
class CacheLocation:
    """Where the compile cache goes, whether it outlives the session, and why."""

    path: Path
    persistent: bool
    note: str


def compile_cache_dir(
    runtime: Any = None,
    environ: Mapping[str, str] | None = None,
    colab_drive: Path = COLAB_DRIVE,
    kaggle_working: Path = KAGGLE_WORKING,
    home: Path | None = None,
) -> CacheLocation:
    """Choose the compile cache folder for this runtime.

    ``runtime`` is anything with ``platform`` (colab, kaggle, tpu-vm, local),
    ``accelerator_type`` and ``tpu_generation`` attributes (``env.detect_runtime()``'s
    result); without it both are read here from the environment and sysfs.

    * ``$TPU_NB_COMPILE_CACHE`` if set;
    * Colab: ``MyDrive/tpu-notebooks/xla-cache/<tag>`` if Drive is mounted, otherwise
      ``/content/xla-cache/<tag>`` (lost with the session: mount Drive first);
    * Kaggle: ``/kaggle/working/xla-cache/<tag>``;
    * TPU VM / local: ``$XDG_CACHE_HOME`` or ``~/.cache``, ``tpu-notebooks/xla-cache/<tag>``.

    ``<tag>`` is ``torch_xla-2.9.0-<accelerator>`` (``cpu`` without a TPU). Reads the
    environment and the file system only.
    """
    env = os.environ if environ is None else environ
    if runtime is None:
        platform, hardware = _platform(env), _hardware(env)
    else:
        platform = runtime.platform
        hardware = runtime.accelerator_type or runtime.tpu_generation or "cpu"
    tag = f"torch_xla-{_torch_xla_version()}-{hardware}"
    if env.get(CACHE_ENV):
        return CacheLocation(Path(env[CACHE_ENV]).expanduser(), True, f"${CACHE_ENV}")
    if platform == "colab":
        if colab_drive.is_dir():
            return CacheLocation(colab_drive / "tpu-notebooks" / "xla-cache" / tag, True,
                                 "Google Drive: survives the Colab session")
        return CacheLocation(Path("/content/xla-cache") / tag, False,
                             "Drive is not mounted: lost with the session "
                             "(from google.colab import drive; "
                             "drive.mount('/content/drive'))")
    if platform == "kaggle":
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
        import torch_xla  # deferred: importing this file stays device-free
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
    import torch_xla.debug.metrics as met  # deferred: never the one to import torch_xla

    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()
            if n.startswith("PersistentCache")}
