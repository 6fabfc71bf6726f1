"""The persistent XLA compile cache, turned on the right way, and what it does on 2.8 and 2.9.

Course code (notebook 05): on the releases the course supports the cache saves no compile, so it
is not in the toolkit. Importing it or choosing the folder never touches the device. The folder
(Drive on Colab, /kaggle/working on Kaggle, else ~/.cache) is named after the torch_xla release
and hardware (``tpu_helpers.env.detect_runtime``).

On torch_xla 2.8 and 2.9 the cache is written but never loaded back, on a TPU exactly as on
XLA:CPU: a new process finds the file, ``DeserializeExecutable`` answers UNIMPLEMENTED (TPU: libtpu;
CPU: the CPU client), torch_xla counts ``PersistentCacheDeserializeFailure`` (never
``PersistentCacheHit``), deletes the file and compiles again (``torch_xla/csrc/runtime/cache.h``
and ``pjrt_computation_client.cpp`` at v2.8.0 and v2.9.0; pytorch/xla issue 9094). No compile is
saved. A fix (``LoadSerializedExecutable``, pull request 9759) was proposed after 2.9.0 and is in
no release. :func:`enable_compile_cache` says so when it turns the cache on.
"""
import importlib.metadata as md
import os
import sys
import warnings
from collections import namedtuple
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpu_helpers.env import detect_runtime

CACHE_ENV = "TPU_NB_COMPILE_CACHE"  # set it to force a cache folder (any platform)
COLAB_DRIVE = Path("/content/drive/MyDrive")
KAGGLE_WORKING = Path("/kaggle/working")
#: torch_xla releases whose cache is written but never loaded back (see the module docstring).
WRITE_ONLY_RELEASES = ("2.8", "2.9")
#: Where the compile cache goes, whether it outlives the session, and why.
CacheLocation = namedtuple("CacheLocation", "path persistent note")


def compile_cache_dir(runtime: Any = None, environ: Mapping[str, str] | None = None,
                      colab_drive: Path = COLAB_DRIVE, kaggle_working: Path = KAGGLE_WORKING,
                      home: Path | None = None) -> CacheLocation:
    """The compile cache folder: ``$TPU_NB_COMPILE_CACHE``, else per platform. ``runtime``: an
    ``env.Runtime`` (default: ``detect_runtime`` of ``environ``)."""
    env = os.environ if environ is None else environ
    runtime = detect_runtime(env) if runtime is None else runtime
    platform = runtime.platform
    hardware = runtime.accelerator_type or runtime.tpu_generation or "cpu"
    release = next((d.version for d in md.distributions(name="torch_xla")), "unknown")
    tag = Path("xla-cache", f"torch_xla-{release.split('+')[0]}-{hardware}")
    if env.get(CACHE_ENV):
        return CacheLocation(Path(env[CACHE_ENV]).expanduser(), True, f"${CACHE_ENV}")
    local = Path(env.get("XDG_CACHE_HOME") or (home or Path.home()) / ".cache")
    base, persistent, note = {
        "colab": (colab_drive / "tpu-notebooks", True, "Google Drive: survives the Colab session")
        if colab_drive.is_dir() else (Path("/content"), False, "Drive is not mounted: lost with "
                                      "the session (from google.colab import drive; "
                                      "drive.mount('/content/drive'))"),
        "kaggle": (kaggle_working, True,
                   "/kaggle/working: kept with a saved version or with persistence on"),
    }.get(platform, (local / "tpu-notebooks", True, "local disk: survives restarts"))
    return CacheLocation(base / tag, persistent, note)


def enable_compile_cache(path: str | os.PathLike[str] | None = None, *,
                         replica: int | None = None, readonly: bool = False) -> Path | None:
    """``xr.initialize_cache`` on ``path`` (default :func:`compile_cache_dir`; ``replica``: a
    sub-folder per process) before the first computation; never fatal: warns, returns None.
    On torch_xla 2.8/2.9 it also warns that the cache is only written (module docstring)."""
    try:
        folder = Path(path if path is not None else compile_cache_dir().path)
        folder = folder / f"replica-{replica}" if replica is not None else folder
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK) and not readonly:
            raise PermissionError(f"{folder} is not writable")
        import torch_xla  # deferred: importing this file stays device-free
        import torch_xla.runtime as xr
        if torch_xla._XLAC._xla_computation_cache_is_initialized():
            raise RuntimeError("something already compiled: enable it before the first computation")
        xr.initialize_cache(str(folder), readonly=readonly)
    except Exception as exc:  # a cache is an optimisation, never a reason to stop
        warnings.warn(f"persistent compile cache not enabled ({type(exc).__name__}: {exc}); "
                      "continuing without it", RuntimeWarning, stacklevel=2)
        return None
    release = torch_xla.__version__.split("+")[0]
    if release.startswith(WRITE_ONLY_RELEASES):
        warnings.warn(f"torch_xla {release} writes the persistent compile cache in {folder} but "
                      "cannot load it back, on a TPU as on XLA:CPU (counter "
                      "PersistentCacheDeserializeFailure, pytorch/xla issue 9094): every new "
                      "process compiles again", RuntimeWarning, stacklevel=2)
    return folder


def cache_counters() -> dict[str, int]:
    """The persistent-cache counters of this process (hits, misses, failures)."""
    if "torch_xla" not in sys.modules:  # never the one to import torch_xla
        return {}
    import torch_xla.debug.metrics as met
    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()
            if n.startswith("PersistentCache")}
