"""PyTorch Lightning 2.6 on TPU: the Trainer arguments, the digits model, exactly-once predictions.

Taught in ``notebooks/06_lightning_on_tpu.ipynb``; ``benchmarks/bench_training.py`` uses
:func:`trainer_kwargs`, :class:`DigitsLightningModule` and :class:`XLACountsCallback` for
its Lightning row.

* :func:`trainer_kwargs`: ``Trainer(**trainer_kwargs(devices))``. On a TPU it is
  Lightning's own ``accelerator="tpu"``; on a machine without TPU it is
  :class:`XLACPUAccelerator`, a small subclass of Lightning's ``XLAAccelerator`` that
  makes Lightning's XLA code path (``SingleDeviceXLAStrategy``, ``XLAPrecision``,
  ``XLACheckpointIO``) run on the XLA:CPU device. The choice comes from
  :func:`tpu_helpers.env.detect_runtime`. Both add :class:`AtomicXLACheckpointIO`
  (Lightning's ``XLACheckpointIO`` writes checkpoints in place, not atomically).
* :class:`DigitsLightningModule`: :class:`course.models.DigitsCNN` as a
  LightningModule, with the loss logged so that it does not force a host sync per step.
* :class:`XLACountsCallback`: compiles, transfers and ``strategy.reduce`` calls per epoch
  and per training step, from :mod:`tpu_helpers.metrics`.
* :class:`ExactlyOncePredictionWriter`: a ``BasePredictionWriter`` for
  ``trainer.predict`` on any number of devices (Lightning issue 7755: ``trainer.predict``
  returns ``None`` when it runs in several processes). Every rank records the dataset
  indices Lightning's sampler gave each batch and writes one file; rank 0 merges the files
  with :func:`tpu_helpers.predict.exactly_once` (order by dataset index, drop repeats,
  check that every index ``0..len(dataset)-1`` is there).

Importing this module imports Lightning but does not touch the XLA device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins import XLACheckpointIO
from lightning.pytorch.accelerators import XLAAccelerator
from lightning.pytorch.callbacks import BasePredictionWriter

from tpu_helpers.checkpoint import load_checkpoint, write_atomically
from tpu_helpers.env import EnvironmentProblem, Runtime, detect_runtime
from tpu_helpers.predict import Ordered, PredictionError, exactly_once

# --------------------------------------------------------------------------- accelerator


class XLACPUAccelerator(XLAAccelerator):
    """Lightning's ``XLAAccelerator`` on the XLA:CPU device (``PJRT_DEVICE=CPU``), one device.

    Lightning's own accelerator counts TPU chips on PCI, so without a TPU it reports
    "not available". This subclass answers the four questions Lightning asks about
    devices (is it available, how many, which ones) for one XLA:CPU device; everything
    else (``SingleDeviceXLAStrategy``, ``XLAPrecision``, ``XLACheckpointIO``) is
    Lightning's unchanged TPU code. Several devices are refused: Lightning's
    ``XLAStrategy`` would fork one process per device, and cross-process collectives
    crash on XLA:CPU (pytorch/xla issue 9089).
    """

    @staticmethod
    def is_available() -> bool:
        if os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
            return False
        try:
            import torch_xla  # noqa: F401  (importing does not start the runtime)
        except ImportError:
            return False
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: int | str | Sequence[int]) -> int | list[int]:
        """Accept ``"auto"``, ``1``, ``"1"``, ``[0]``; refuse the rest with the reason."""
        value: Any = devices
        if isinstance(value, str):
            text = value.strip()
            if text == "auto":
                return 1
            try:
                value = int(text)
            except ValueError:
                try:
                    value = [int(p) for p in text.split(",") if p.strip()]
                except ValueError:
                    value = text
        if isinstance(value, bool):
            value = str(value)  # bool is an int subclass; refuse it below
        if isinstance(value, int) and value == 1:
            return 1
        if isinstance(value, Sequence) and not isinstance(value, str) and list(value) == [0]:
            return [0]
        raise ValueError(
            f"devices={devices!r} cannot run on XLA:CPU: this emulation has one XLA device, "
            "use devices=1, [0] or 'auto'. On a TPU, Lightning accepts 1, all devices or "
            "[i]; here Lightning's XLAStrategy would fork one process per device and "
            "cross-process collectives crash on XLA:CPU (pytorch/xla issue 9089)."
        )

    @staticmethod
    def get_parallel_devices(devices: int | list[int]) -> list[torch.device]:
        index = devices[0] if isinstance(devices, list) else 0
        return [torch.device("xla", index)]

    @staticmethod
    def name() -> str:
        return "xla_cpu"


class AtomicXLACheckpointIO(XLACheckpointIO):
    """Lightning's ``XLACheckpointIO``, but the file is replaced atomically.

    ``XLACheckpointIO.save_checkpoint`` moves the state to the CPU and ``torch.save``\\ s it
    straight onto the final name, so a kill mid-write leaves a truncated checkpoint
    (Lightning's CPU/GPU ``TorchCheckpointIO`` does write atomically). Here the CPU copy
    goes through :func:`tpu_helpers.checkpoint.write_atomically` (temp file, fsync,
    ``os.replace``).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        import torch_xla.core.xla_model as xm

        # the same host copy XLACheckpointIO makes: every XLA tensor in one batched transfer
        write_atomically(path, xm._maybe_convert_to_cpu(checkpoint, convert=True))

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's resume and ``load_from_checkpoint`` path, through
        :func:`tpu_helpers.checkpoint.load_checkpoint`: plain tensors and containers only,
        even if the caller asks for ``weights_only=False`` (a crafted checkpoint cannot
        run code). ``map_location`` is ignored: it loads to the CPU, as Lightning's
        XLA strategy does before moving the state to the device."""
        return load_checkpoint(path)


def _check_devices_argument(devices: Any) -> None:
    ok = (devices == "auto" or (isinstance(devices, int) and not isinstance(devices, bool)
                                and devices >= 1)
          or (isinstance(devices, str) and devices.strip().replace(",", "").isdigit())
          or (isinstance(devices, list | tuple) and len(devices) == 1
              and isinstance(devices[0], int) and devices[0] >= 0))
    if not ok:
        raise ValueError(
            f"devices={devices!r}: Lightning 2.6 on TPU takes 'auto', 1, the number of "
            "devices on this host (e.g. 8 on a v5e-8, 4 on a v4-8) or a one-element list [i]."
        )


def trainer_kwargs(devices: int | str | Sequence[int] = "auto", *,
                   runtime: Runtime | None = None) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` on this machine: accelerator, devices, plugins.

    * TPU attached (:func:`tpu_helpers.env.detect_runtime`): ``accelerator="tpu"`` and your
      ``devices``, passed through to Lightning's own checks.
    * No TPU: :class:`XLACPUAccelerator` with ``devices`` checked here (1, ``[0]`` or
      ``"auto"``); needs ``PJRT_DEVICE=CPU`` (``configure_emulation()``).

    ``plugins`` holds :class:`AtomicXLACheckpointIO` in both cases. Raises ``ValueError``
    for a ``devices`` value Lightning would refuse, before any device is touched.
    """
    _check_devices_argument(devices)
    rt = runtime or detect_runtime()
    plugins = [AtomicXLACheckpointIO()]
    if rt.has_tpu:
        return {"accelerator": "tpu", "devices": devices, "plugins": plugins}
    if not XLACPUAccelerator.is_available():
        raise EnvironmentProblem(
            "No TPU here and PJRT_DEVICE is not CPU: call "
            "tpu_helpers.env.configure_emulation(num_devices=1) before building the Trainer."
        )
    return {"accelerator": XLACPUAccelerator(),
            "devices": XLACPUAccelerator.parse_devices(devices), "plugins": plugins}


# --------------------------------------------------------------------------- the model

LossLogging = Literal["epoch", "logger", "prog_bar"]


# --------------------------------------------------------------------------- measuring


# --------------------------------------------------------------------------- predictions

RANK_FILE = "rank{rank:05d}-of-{world_size:05d}.pt"
MERGED_FILE = "predictions.pt"


def rank_file(output_dir: str | Path, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` writes its records."""
    return Path(output_dir) / RANK_FILE.format(rank=rank, world_size=world_size)


def merge_rank_files(output_dir: str | Path, world_size: int, n: int) -> Ordered:
    """Merge every rank's records into dataset order with :func:`~tpu_helpers.predict.exactly_once`.

    Checks that each of the ``world_size`` rank files exists and was written for a
    dataset of ``n`` samples, then orders by dataset index, drops repeats (counted in
    ``duplicates``) and checks that every index ``0..n-1`` is there exactly once.
    Raises :class:`~tpu_helpers.predict.PredictionError` naming the missing or
    inconsistent file, or the missing indices.
    """
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for rank in range(world_size):
        path = rank_file(output_dir, rank, world_size)
        if not path.is_file():
            raise PredictionError(f"{path}: missing; rank {rank} of {world_size} did not "
                                  "write its predictions.")
        rec = load_checkpoint(path)  # plain tensors and containers only: cannot run code
        if rec["n"] != n or rec["world_size"] != world_size:
            raise PredictionError(f"{path}: written for {rec['n']} samples on "
                                  f"{rec['world_size']} ranks, merging {n} on {world_size}.")
        if rec["index"].numel():
            parts.append((rec["index"], rec["mask"], rec["values"]))
    if not parts:
        raise PredictionError(f"{output_dir}: no rank recorded any prediction rows.")
    row_shapes = {tuple(v.shape[1:]) for _, _, v in parts}
    if len(row_shapes) > 1:
        raise PredictionError(f"ranks wrote prediction rows of different shapes {row_shapes}.")
    return exactly_once(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                        torch.cat([p[2] for p in parts]), n=n)


def read_predictions(output_dir: str | Path) -> Ordered:
    """The merged predictions rank 0 wrote (works in the launching process too)."""
    path = Path(output_dir) / MERGED_FILE
    if not path.is_file():
        raise PredictionError(f"{path}: missing; did trainer.predict finish with an "
                              "ExactlyOncePredictionWriter writing here?")
    rec = load_checkpoint(path)
    return Ordered(rec["index"].numpy(), rec["values"], int(rec["duplicates"]))


class ExactlyOncePredictionWriter(BasePredictionWriter):
    """Every prediction exactly once, in dataset order, from ``trainer.predict`` on any devices.

    Per batch (``write_on_batch_end``) it keeps the prediction on the host with the dataset
    indices Lightning's sampler put in that batch (``batch_indices``). At the end of the
    predict epoch every rank writes its records to ``rankR-of-W.pt`` in ``output_dir``
    (atomically), all ranks meet at ``trainer.strategy.barrier``, and rank 0 merges the
    files with :func:`merge_rank_files` into ``predictions.pt`` (atomically), checked to
    hold each index ``0..len(dataset)-1`` once. ``predictions`` holds the merged
    :class:`~tpu_helpers.predict.Ordered` on rank 0; :func:`read_predictions` reads the file
    from any process (with several TPU devices the callbacks run in forked processes, so
    the launching process only sees the file).

    One predict dataloader, predictions a tensor with one row per sample. Each batch's
    prediction is copied to the host as it is written (one transfer per batch; this also
    ends the lazy graph per batch on a single XLA device, where Lightning itself does not).
    """

    def __init__(self, output_dir: str | Path, n: int | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self.n = n
        self.predictions: Ordered | None = None
        self._index: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    # ---- recording (no trainer needed: the unit tests drive it like Lightning does)
    def reset(self) -> None:
        self._index, self._values, self.predictions = [], [], None

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        if dataloader_idx != 0:
            raise PredictionError(f"{type(self).__name__} supports one predict dataloader; "
                                  f"got dataloader {dataloader_idx}.")
        if not isinstance(prediction, torch.Tensor):
            raise PredictionError(f"predict batch {batch_idx}: predict_step returned a "
                                  f"{type(prediction).__name__}; return one tensor with a "
                                  "row per sample.")
        if not batch_indices:
            raise PredictionError(
                f"predict batch {batch_idx}: Lightning did not report which dataset indices "
                "it holds; use a torch DataLoader over a map-style dataset (with __len__) "
                "so Lightning can track them.")
        if prediction.shape[0] != len(batch_indices):
            raise PredictionError(
                f"predict batch {batch_idx}: {prediction.shape[0]} prediction rows for "
                f"{len(batch_indices)} dataset indices (first: {list(batch_indices[:4])}).")
        self._index.append(torch.as_tensor(list(batch_indices), dtype=torch.int64))
        self._values.append(prediction.detach().to("cpu"))

    def save_rank(self, rank: int, world_size: int, n: int) -> Path:
        """Write this rank's records to its rank file (atomically)."""
        index = torch.cat(self._index) if self._index else torch.zeros(0, dtype=torch.int64)
        values = torch.cat(self._values) if self._values else torch.zeros(0)
        record = {"rank": rank, "world_size": world_size, "n": n, "index": index,
                  "mask": torch.ones(index.shape, dtype=torch.bool), "values": values}
        return write_atomically(rank_file(self.output_dir, rank, world_size), record)

    def merge(self, world_size: int, n: int) -> Ordered:
        """Rank 0's step: merge all rank files, write ``predictions.pt``, keep the result."""
        merged = merge_rank_files(self.output_dir, world_size, n)
        values = merged.values
        record = {"index": torch.from_numpy(merged.index),
                  "values": values if isinstance(values, torch.Tensor) else
                  torch.from_numpy(values), "duplicates": merged.duplicates,
                  "n": n, "world_size": world_size}
        write_atomically(self.output_dir / MERGED_FILE, record)
        self.predictions = merged
        return merged

    # ---- Lightning hooks
    def _dataset_length(self, trainer: L.Trainer) -> int:
        loaders = trainer.predict_dataloaders
        if isinstance(loaders, list | tuple):
            if len(loaders) != 1:
                raise PredictionError(f"{type(self).__name__} supports one predict "
                                      f"dataloader; got {len(loaders)}.")
            loaders = loaders[0]
        dataset = getattr(loaders, "dataset", None)
        try:
            length = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            length = None
        if self.n is not None:
            if length is not None and length != self.n:
                raise PredictionError(f"the predict dataset has {length} samples but the "
                                      f"writer was told n={self.n}.")
            return self.n
        if length is None:
            raise PredictionError("cannot tell the predict dataset's length: pass n=... to "
                                  f"{type(self).__name__}.")
        return length

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reset()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if trainer.is_global_zero:
            (self.output_dir / MERGED_FILE).unlink(missing_ok=True)
        for old in self.output_dir.glob(f"rank{trainer.global_rank:05d}-of-*.pt"):
            old.unlink()  # this rank's records from an earlier run in this folder

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = self._dataset_length(trainer)
        self.save_rank(trainer.global_rank, trainer.world_size, n)
        trainer.strategy.barrier("ExactlyOncePredictionWriter.rank_files")
        if trainer.is_global_zero:
            self.merge(trainer.world_size, n)
        trainer.strategy.barrier("ExactlyOncePredictionWriter.merged")

    def as_array(self) -> np.ndarray:
        """The merged predictions (rank 0) as a numpy array in dataset order."""
        if self.predictions is None:
            raise PredictionError("no merged predictions in this process: run "
                                  "trainer.predict first, or use read_predictions(output_dir).")
        values = self.predictions.values
        return values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
