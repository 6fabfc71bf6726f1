"""The lanes' start-up hook: with this folder on PYTHONPATH, every Python process (a Jupyter
kernel, forked or spawned replicas, pool workers, subprocesses) runs it at start-up.

* ``JAX_LANE=1`` (the jax lane; the jax overlay on PYTHONPATH too): the process leaves proof
  that jax was on its path: ``<pid>.json`` in ``$JAX_LANE_DIR`` records where ``import jax``
  would load jax from (``importlib.util.find_spec``, nothing imported) and the version. When the
  process later imports jax, torchax (torch_xla's bundled copy) or flax, the file is rewritten
  with what was imported, what failed to import (torch_xla 2.9's torchax needs flax) and
  torch's ``privateuse1`` backend name ("jax" once torchax registered itself).
* ``TPU_NUMERICS=1`` (the TPU-numerics lane): right after ``torch_xla`` is first imported, on
  the importing thread, ``tpu_numerics.install()`` emulates a TPU's matmul numerics. Nothing is
  imported at start-up, so processes that never import torch_xla pay nothing.

Both can be on at once (the platform runs, ``make test-platforms``). The ``sitecustomize`` that
this one shadows (the next one on ``sys.path`` after this folder) still runs (chained).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_JAX_WATCHED = ("jax", "torchax", "flax")
_seen: dict = {"imported": [], "failed": {}, "privateuse1": None}


def _write(extra: dict) -> None:
    folder = os.environ.get("JAX_LANE_DIR")
    if not folder:
        return
    try:
        import importlib.metadata as md
        spec = importlib.util.find_spec("jax")
        try:
            version = md.version("jax")
        except md.PackageNotFoundError:
            version = None
        record = {"pid": os.getpid(), "argv": list(getattr(sys, "orig_argv", sys.argv))[:4],
                  "jax_origin": spec.origin if spec else None, "jax_version": version, **extra}
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.getpid()}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(folder, f"{os.getpid()}.json"))
    except Exception:  # proof is best effort: never break the process under test
        pass


def _jax_noted(name: str, exec_module):
    def exec_and_note(module):
        try:
            exec_module(module)
        except BaseException as exc:
            _seen["failed"][name] = f"{type(exc).__name__}: {exc}"[:200]
            _write(_seen)
            raise
        _seen["imported"].append(name)
        torch = sys.modules.get("torch")
        if torch is not None:
            _seen["privateuse1"] = torch._C._get_privateuse1_backend_name()
        _write(_seen)
    return exec_and_note


def _numerics_installed(name: str, exec_module):
    def exec_then_install(module):
        exec_module(module)
        import tpu_numerics
        tpu_numerics.install()
    return exec_then_install


class _Hook:
    """A meta-path finder that wraps the loader of the watched top-level modules (``{name:
    wrapper}``): the wrapper runs around the module's own execution."""

    def __init__(self, wrappers: dict):
        self.wrappers = wrappers
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.wrappers or getattr(self._busy, "on", False):
            return None
        self._busy.on = True  # the finders asked below must not come back here
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader.exec_module = self.wrappers[fullname](
                        fullname, spec.loader.exec_module)
                    return spec
            return None
        finally:
            self._busy.on = False


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path after this folder (the one this file shadows)."""
    entries = [os.path.abspath(e) if e else "" for e in sys.path]
    start = entries.index(_HERE) + 1 if _HERE in entries else 0
    for entry in entries[start:]:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry and entry != _HERE and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_wrappers = {}
if os.environ.get("JAX_LANE") == "1":
    _write(_seen)
    _wrappers.update(dict.fromkeys(_JAX_WATCHED, _jax_noted))
if os.environ.get("TPU_NUMERICS") == "1":
    _wrappers["torch_xla"] = _numerics_installed
if _wrappers:
    sys.meta_path.insert(0, _Hook(_wrappers))
_chain()
