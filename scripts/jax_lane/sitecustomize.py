"""With ``JAX_LANE=1`` and this folder plus the jax overlay on PYTHONPATH, every Python process
(a Jupyter kernel, the processes it starts) leaves proof that jax was on its path: at start-up
``<pid>.json`` in ``$JAX_LANE_DIR`` records where ``import jax`` would load jax from (found by
``importlib.util.find_spec``, nothing imported) and the version. When the process later imports
jax, torchax (torch_xla's bundled copy) or flax, the file is rewritten with what was imported,
what failed to import (torch_xla 2.9's torchax needs flax) and torch's ``privateuse1`` backend
name ("jax" once torchax registered itself). Another ``sitecustomize`` later on ``sys.path``
still runs (chained).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_WATCHED = ("jax", "torchax", "flax")


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


_seen: dict = {"imported": [], "failed": {}, "privateuse1": None}


class _Watch:
    """A meta-path finder that notes when a watched top-level package is imported (or fails)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                _wrap(fullname, spec.loader)
                return spec
        return None


def _wrap(name: str, loader) -> None:
    exec_module = loader.exec_module

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

    loader.exec_module = exec_and_note


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path, the one this file shadows (if any)."""
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("JAX_LANE") == "1":
    _write(_seen)
    sys.meta_path.insert(0, _Watch())
_chain()
