"""With ``TPU_NUMERICS=1`` and this folder on PYTHONPATH, every Python process (a Jupyter
kernel, forked or spawned replicas, pool workers) emulates a TPU's matmul numerics: the
emulation (``tpu_numerics.install``) is installed right after ``torch_xla`` is first imported,
on the importing thread. Nothing is imported at start-up, so processes that never import
torch_xla pay nothing. Another ``sitecustomize`` later on ``sys.path`` still runs (chained).
"""

from __future__ import annotations

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _AfterTorchXla:
    """A meta-path finder that runs ``tpu_numerics.install()`` once ``torch_xla`` is imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_xla":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                _wrap(spec.loader)
                return spec
        return None


def _wrap(loader) -> None:
    exec_module = loader.exec_module

    def exec_then_install(module):
        exec_module(module)
        import tpu_numerics
        tpu_numerics.install()

    loader.exec_module = exec_then_install


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


if os.environ.get("TPU_NUMERICS") == "1":
    sys.meta_path.insert(0, _AfterTorchXla())
_chain()
