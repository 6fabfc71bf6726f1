"""PyTorch Lightning 2.6 on TPU: Trainer arguments, atomic checkpoints, exactly-once predictions.

Taught in ``notebooks/06_lightning_on_tpu.ipynb``. Copy it with its two siblings,
``checkpoint.py`` (atomic writes, safe loading) and ``ordering.py`` (the rank-file format
and the exactly-once merge), the one module allowed two, and save it under another name
(e.g. ``tpu_lightning.py``): a ``lightning.py`` in your project hides the lightning package.

* :func:`trainer_kwargs`: ``Trainer(**trainer_kwargs(devices))`` on a TPU: Lightning's own
  ``accelerator="tpu"``, your ``devices`` checked before anything starts, and
  :class:`AtomicXLACheckpointIO`. Without a TPU it does not pick anything for you: Lightning's
  TPU accelerator is "not available" there. The course runs the same code on the XLA:CPU
  device through a small accelerator of its own (``course.lightning_demo.XLACPUAccelerator``,
  passed as ``accelerator=``): emulation scaffolding a TPU user never needs.
* :class:`AtomicXLACheckpointIO`: Lightning's ``XLACheckpointIO`` writes its checkpoint with a
  plain ``torch.save`` onto the final name; this one writes through
  :func:`checkpoint.atomic_write` and loads through :func:`checkpoint.load_checkpoint`
  (tensors and plain containers only: a crafted checkpoint cannot run code).
* :class:`ExactlyOncePredictionWriter`: ``trainer.predict`` returns ``None`` when Lightning
  runs several processes (8 on a v5e-8; Lightning issue 7755). Every rank records the dataset
  indices Lightning's sampler put in each batch, writes one rank file
  (:func:`ordering.save_rank_file`, atomically), and rank 0 merges them with
  :func:`ordering.merge_rank_files`: in dataset order, repeats dropped, every index
  ``0..len(dataset)-1`` checked. :func:`read_predictions` gives the result in any process.

Importing this module imports Lightning and torch_xla but does not touch the XLA device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch_xla.core.xla_model as xm  # importing it does not start the runtime
from lightning.fabric.plugins import XLACheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import BasePredictionWriter

try:  # in the tpu_helpers package
    from tpu_helpers.checkpoint import atomic_write, load_checkpoint
    from tpu_helpers.ordering import (
        Ordered,
        PredictionError,
        merge_rank_files,
        rank_file_name,
        save_rank_file,
    )
except ImportError:  # copied into your project next to checkpoint.py and ordering.py
    from checkpoint import atomic_write, load_checkpoint
    from ordering import Ordered, PredictionError, merge_rank_files, rank_file_name, save_rank_file

#: Written by rank 0 once every rank file is merged: which files make up the result.
MERGED_FILE = "merged.json"

# --------------------------------------------------------------------------- the Trainer


class AtomicXLACheckpointIO(XLACheckpointIO):
    """Lightning's ``XLACheckpointIO``, but the file is replaced atomically and loaded safely.

    A kill mid-write (a preempted TPU VM) leaves the old checkpoint or the new one, never a
    truncated file; loading refuses anything but tensors and plain containers.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        # the host copy XLACheckpointIO makes: every XLA tensor in one batched transfer
        cpu_state = xm._maybe_convert_to_cpu(checkpoint, convert=True)
        atomic_write(path, lambda f: torch.save(cpu_state, f))

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's resume and ``load_from_checkpoint`` path: ``weights_only`` loading even
        if the caller asks for ``weights_only=False``. ``map_location`` is ignored: it loads
        to the CPU, as Lightning's XLA strategies do before moving the state to the device."""
        return load_checkpoint(path)


def _check_devices(devices: Any) -> None:
    ok = (devices == "auto"
          or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)
          or (isinstance(devices, str) and devices.strip().replace(",", "").isdigit())
          or (isinstance(devices, list | tuple) and len(devices) == 1
              and isinstance(devices[0], int) and devices[0] >= 0))
    if not ok:
        raise ValueError(
            f"devices={devices!r}: Lightning 2.6 on TPU takes 'auto', 1, the number of "
            "devices on this host (e.g. 8 on a v5e-8, 4 on a v4-8) or a one-element list [i].")


def trainer_kwargs(devices: int | str | Sequence[int] = "auto", *,
                   accelerator: str | Accelerator = "tpu") -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` on a TPU host.

    ``{"accelerator": "tpu", "devices": devices, "plugins": [AtomicXLACheckpointIO()]}``.
    ``devices``: ``"auto"`` (every device of the host: several processes if more than one),
    ``1``, the host's device count, or ``[i]``; anything else raises ``ValueError`` here,
    before Lightning starts. ``accelerator``: another XLA accelerator (the course passes an
    XLA:CPU one). Touches no device.
    """
    _check_devices(devices)
    return {"accelerator": accelerator, "devices": devices,
            "plugins": [AtomicXLACheckpointIO()]}


# --------------------------------------------------------------------------- predictions


def rank_file(output_dir: str | Path, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` writes its rows (:func:`ordering.rank_file_name`)."""
    return Path(output_dir) / rank_file_name(rank, world_size)


def read_predictions(output_dir: str | Path) -> Ordered:
    """The merged predictions in dataset order, in any process (also the one that launched
    the ranks): reads :data:`MERGED_FILE` and merges the rank files it names again."""
    path = Path(output_dir) / MERGED_FILE
    try:
        info = json.loads(path.read_text())
        world_size, n = int(info["world_size"]), int(info["n"])
    except FileNotFoundError:
        raise PredictionError(f"{path}: missing; did trainer.predict finish with an "
                              "ExactlyOncePredictionWriter writing here?") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PredictionError(f"{path}: not a readable merge record ({exc}).") from None
    return merge_rank_files(output_dir, world_size, n)


class ExactlyOncePredictionWriter(BasePredictionWriter):
    """Every prediction exactly once, in dataset order, from ``trainer.predict`` on any devices.

    Per batch it copies the prediction to the host (one transfer per batch) with the dataset
    indices Lightning's sampler put in it (``batch_indices``). At the end of the predict
    epoch every rank writes its rank file in ``output_dir``, all ranks meet at
    ``trainer.strategy.barrier``, and rank 0 merges the files (``predictions`` holds the
    :class:`ordering.Ordered` result there) and writes :data:`MERGED_FILE`. With several
    processes the writer object in your notebook is not the one that ran (each process has
    its own copy): use :func:`read_predictions`.

    One predict dataloader over a map-style dataset; ``predict_step`` returns one tensor with
    a row per sample. ``n``: the dataset length, if ``len(dataset)`` does not give it.
    """

    def __init__(self, output_dir: str | Path, n: int | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self.n = n
        self.predictions: Ordered | None = None
        self._index: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        where = f"predict batch {batch_idx}"
        if dataloader_idx != 0:
            raise PredictionError(f"{where}: {type(self).__name__} supports one predict "
                                  f"dataloader; got dataloader {dataloader_idx}.")
        if not isinstance(prediction, torch.Tensor):
            raise PredictionError(f"{where}: predict_step returned a "
                                  f"{type(prediction).__name__}; return one tensor with a "
                                  "row per sample.")
        if not batch_indices:
            raise PredictionError(
                f"{where}: Lightning did not report which dataset indices it holds; use a "
                "torch DataLoader over a map-style dataset (with __len__).")
        if prediction.shape[0] != len(batch_indices):
            raise PredictionError(
                f"{where}: {prediction.shape[0]} prediction rows for {len(batch_indices)} "
                f"dataset indices (first: {list(batch_indices[:4])}).")
        rows = prediction.detach().to("cpu")
        if rows.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            rows = rows.float()
        self._index.append(np.asarray(batch_indices, dtype=np.int64))
        self._values.append(rows.numpy())

    def save_rank(self, rank: int, world_size: int, n: int) -> Path:
        """Write this rank's rows to its rank file, atomically."""
        index = np.concatenate(self._index) if self._index else np.zeros(0, np.int64)
        values = np.concatenate(self._values) if self._values else np.zeros(0, np.float32)
        mask = np.ones(index.shape, dtype=bool)
        return atomic_write(rank_file(self.output_dir, rank, world_size), lambda f: save_rank_file(
            f, index, mask, values, rank=rank, world_size=world_size, n=n))

    def merge(self, world_size: int, n: int) -> Ordered:
        """Rank 0's step: merge every rank file, then record the merge in :data:`MERGED_FILE`."""
        self.predictions = merge_rank_files(self.output_dir, world_size, n)
        record = {"world_size": world_size, "n": n,
                  "duplicates": self.predictions.duplicates,
                  "files": [rank_file_name(r, world_size) for r in range(world_size)]}
        atomic_write(self.output_dir / MERGED_FILE, lambda f: f.write(json.dumps(record).encode()))
        return self.predictions

    def _dataset_length(self, trainer: L.Trainer) -> int:
        loaders = trainer.predict_dataloaders
        if isinstance(loaders, list | tuple):
            if len(loaders) != 1:
                raise PredictionError(f"{type(self).__name__} supports one predict "
                                      f"dataloader; got {len(loaders)}.")
            loaders = loaders[0]
        try:
            length = len(loaders.dataset)
        except (AttributeError, TypeError):
            length = None
        if self.n is None and length is None:
            raise PredictionError("cannot tell the predict dataset's length: pass n=... to "
                                  f"{type(self).__name__}.")
        if self.n is not None and length is not None and length != self.n:
            raise PredictionError(f"the predict dataset has {length} samples but the writer "
                                  f"was told n={self.n}.")
        return self.n if self.n is not None else length

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._index, self._values, self.predictions = [], [], None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if trainer.is_global_zero:
            (self.output_dir / MERGED_FILE).unlink(missing_ok=True)
        rank_file(self.output_dir, trainer.global_rank, trainer.world_size).unlink(missing_ok=True)

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = self._dataset_length(trainer)
        self.save_rank(trainer.global_rank, trainer.world_size, n)
        trainer.strategy.barrier("ExactlyOncePredictionWriter.rank_files")
        if trainer.is_global_zero:
            self.merge(trainer.world_size, n)
        trainer.strategy.barrier("ExactlyOncePredictionWriter.merged")
