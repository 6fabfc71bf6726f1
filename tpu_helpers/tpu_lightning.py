"""PyTorch Lightning 2.6 on TPU: Trainer arguments and atomic, safely loaded checkpoints.

Taught in notebook 06. Copy it with ``checkpoint.py`` (a ``lightning.py`` would hide the
lightning package). Importing it does not touch the XLA device. Notebook 06's exactly-once
prediction writer (``trainer.predict`` returns ``None`` with several processes, Lightning
issue 7755) is a unit of its own beside this one: ``lightning_writer.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch_xla.core.xla_model as xm  # importing it does not start the runtime
from lightning.fabric.plugins import XLACheckpointIO
from lightning.pytorch.accelerators import Accelerator

try:  # in the tpu_helpers package
    from tpu_helpers.checkpoint import atomic_write, load_checkpoint
except ImportError:  # copied into your project next to checkpoint.py
    from checkpoint import atomic_write, load_checkpoint


class AtomicXLACheckpointIO(XLACheckpointIO):
    """Lightning's ``XLACheckpointIO``, but the file is replaced atomically and loaded safely."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        cpu_state = xm._maybe_convert_to_cpu(checkpoint, convert=True)  # one batched transfer
        atomic_write(path, lambda f: torch.save(cpu_state, f))

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """``weights_only`` loading onto the CPU, whatever ``weights_only``/``map_location`` say."""
        return load_checkpoint(path)


def trainer_kwargs(devices: int | str | Sequence[int] = "auto", *,
                   accelerator: str | Accelerator = "tpu") -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` on a TPU host; touches no device.
    ``devices``: ``"auto"``, ``1``, the host's device count or ``[i]``, else ``ValueError``."""
    ok = (devices == "auto"
          or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)
          or (isinstance(devices, str) and devices.strip().replace(",", "").isdigit())
          or (isinstance(devices, list | tuple) and len(devices) == 1
              and isinstance(devices[0], int) and devices[0] >= 0))
    if not ok:
        raise ValueError(
            f"devices={devices!r}: Lightning 2.6 on TPU takes 'auto', 1, the number of "
            "devices on this host (e.g. 8 on a v5e-8, 4 on a v4-8) or a one-element list [i].")
    return {"accelerator": accelerator, "devices": devices, "plugins": [AtomicXLACheckpointIO()]}
