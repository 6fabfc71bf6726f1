"""Lightning 2.6's exactly-once prediction writer: every prediction once, in dataset order.

``trainer.predict`` returns ``None`` with several processes (Lightning issue 7755):
:class:`ExactlyOncePredictionWriter` has each rank write its rows to a rank file and rank 0
merge them; :func:`read_predictions` gives the merged result in any process, and
``writer.predict(trainer, model, loader)`` also handles fewer samples than processes
(:class:`PaddedToWorld`). Taught in notebook 06, section 7; it sits beside ``tpu_lightning.py``
(the Trainer arguments), which it does not need. Copy it with ``ordering.py`` (the rank-file
format and the exactly-once merge notebook 04's ``predict`` shares) and ``checkpoint.py``
(``atomic_write``). Importing it does not touch the XLA device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, Dataset

try:  # inside the tpu_helpers package
    from .checkpoint import atomic_write
    from .ordering import Ordered, PredictionError, merge_rank_files, rank_file_name, save_rank_file
except ImportError:  # copied next to checkpoint.py and ordering.py into your project
    from checkpoint import atomic_write  # type: ignore[no-redef]
    from ordering import (  # type: ignore[no-redef]
        Ordered,
        PredictionError,
        merge_rank_files,
        rank_file_name,
        save_rank_file,
    )

#: Written by rank 0 once every rank file is merged: which files make up the result.
MERGED_FILE = "merged.json"


def read_predictions(output_dir: str | Path) -> Ordered:
    """The merged predictions in dataset order, in any process: merges the rank files again."""
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


class PaddedToWorld(Dataset):
    """``dataset`` grown to ``length`` items by repeating its last one; the writer drops the
    repeats (dataset index ``>= len(dataset)``). Lightning 2.6's predict sampler
    (``UnrepeatedDistributedSampler``, lightning/pytorch/overrides/distributed.py) asserts a
    sample for every process, so 5 samples on 8 processes need 3 padding items."""

    def __init__(self, dataset: Any, length: int) -> None:
        self.dataset, self.n, self.length = dataset, len(dataset), max(length, len(dataset))
        if self.n < 1:
            raise PredictionError("the predict dataset is empty: nothing to predict.")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[min(index, self.n - 1)]


def _dataset_length(loader: Any) -> int | None:
    """The real length of ``loader``'s dataset (a :class:`PaddedToWorld`'s without padding)."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, PaddedToWorld):
        return dataset.n
    try:
        return len(dataset)
    except TypeError:
        return None


class ExactlyOncePredictionWriter(BasePredictionWriter):
    """Every prediction exactly once, in dataset order, from ``trainer.predict`` on any devices.

    Each rank writes a rank file (Lightning's ``batch_indices``); rank 0 merges them
    (``predictions``). With several processes use :func:`read_predictions`, or :meth:`predict`,
    which also handles fewer samples than processes. One predict dataloader over a map-style
    dataset; ``predict_step`` returns one tensor, a row per sample.
    """

    def __init__(self, output_dir: str | Path, n: int | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir, self.n = Path(output_dir), n
        self.predictions: Ordered | None = None
        self._index: list[np.ndarray] = []  # per batch: dataset indices, and the rows
        self._values: list[np.ndarray] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        where = f"predict batch {batch_idx}"
        if dataloader_idx != 0:
            raise PredictionError(f"{where}: {type(self).__name__} supports one predict "
                                  f"dataloader; got dataloader {dataloader_idx}.")
        if not isinstance(prediction, torch.Tensor):
            raise PredictionError(f"{where}: predict_step returned a {type(prediction).__name__};"
                                  " return one tensor with a row per sample.")
        if not batch_indices:
            raise PredictionError(f"{where}: Lightning did not report which dataset indices it "
                                  "holds; use a torch DataLoader over a map-style dataset.")
        if prediction.shape[0] != len(batch_indices):
            raise PredictionError(
                f"{where}: {prediction.shape[0]} prediction rows for {len(batch_indices)} "
                f"dataset indices (first: {list(batch_indices[:4])}).")
        rows = prediction.detach().cpu()  # numpy has no bfloat16; float32 holds it exactly
        self._values.append((rows.float() if rows.dtype == torch.bfloat16 else rows).numpy())
        self._index.append(np.asarray(batch_indices, dtype=np.int64))

    def predict(self, trainer: L.Trainer, model: L.LightningModule, loader: DataLoader) -> Ordered:
        """``trainer.predict(model, loader)`` with this writer; the merged rows in this process.
        With fewer samples than processes the dataset is padded (:class:`PaddedToWorld`)."""
        if not any(cb is self for cb in trainer.callbacks):
            raise PredictionError("this writer is not in the Trainer's callbacks: "
                                  "L.Trainer(..., callbacks=[writer]).")
        n = _dataset_length(loader)
        if n is None or n < 1:
            raise PredictionError(f"the predict loader's dataset has length {n}: "
                                  "predict needs a map-style dataset with at least one sample.")
        # trainer.world_size reads 1 in this process until XLAStrategy has forked
        # (lightning/pytorch/strategies/xla.py): count the processes it will fork instead.
        processes = trainer.num_devices * trainer.num_nodes
        if n < processes:
            loader = DataLoader(PaddedToWorld(loader.dataset, processes),
                                batch_size=loader.batch_size, collate_fn=loader.collate_fn,
                                num_workers=loader.num_workers)
        trainer.predict(model, loader, return_predictions=False)
        return read_predictions(self.output_dir)

    def save_rank(self, rank: int, world_size: int, n: int, padded: bool = False) -> Path:
        """Write this rank's rows to its rank file, atomically. ``padded``: the dataset was a
        :class:`PaddedToWorld`, drop its padding rows (index ``>= n``)."""
        index = np.concatenate(self._index) if self._index else np.zeros(0, np.int64)
        values = np.concatenate(self._values) if self._values else np.zeros(0, np.float32)
        if padded:
            index, values = index[index < n], values[index < n]
        path = self.output_dir / rank_file_name(rank, world_size)
        return atomic_write(path, lambda f: save_rank_file(
            f, index, np.ones(index.shape, bool), values, rank=rank, world_size=world_size, n=n))

    def merge(self, world_size: int, n: int) -> Ordered:
        """Rank 0's step: merge every rank file, then record the merge in :data:`MERGED_FILE`."""
        self.predictions = merge_rank_files(self.output_dir, world_size, n)
        record = {"world_size": world_size, "n": n, "duplicates": self.predictions.duplicates,
                  "files": [rank_file_name(r, world_size) for r in range(world_size)]}
        atomic_write(self.output_dir / MERGED_FILE, lambda f: f.write(json.dumps(record).encode()))
        return self.predictions

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Every rank, before Lightning builds its predict sampler: fewer samples than ranks
        would fail its assert on some ranks only; fail here on all, with the way out."""
        super().setup(trainer, pl_module, stage)
        source = getattr(getattr(trainer, "predict_loop", None), "_data_source", None)
        try:  # the loader passed to trainer.predict (Lightning 2.6's _DataConnectorSource)
            n = len(source.instance.dataset)
        except (AttributeError, TypeError):
            return
        if stage == "predict" and n < trainer.world_size:
            raise PredictionError(
                f"{n} samples to predict on {trainer.world_size} processes: Lightning 2.6 needs "
                "one per process (UnrepeatedDistributedSampler). Call writer.predict(trainer, "
                "model, loader), which pads the dataset and drops the padding.")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._index, self._values, self.predictions = [], [], None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if trainer.is_global_zero:
            (self.output_dir / MERGED_FILE).unlink(missing_ok=True)
        own = self.output_dir / rank_file_name(trainer.global_rank, trainer.world_size)
        own.unlink(missing_ok=True)

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loaders = trainer.predict_dataloaders  # a second one failed at its first batch
        if isinstance(loaders, list | tuple):
            loaders = loaders[0]
        length = _dataset_length(loaders)
        if self.n is None and length is None:
            raise PredictionError("cannot tell the predict dataset's length: pass n=... to "
                                  f"{type(self).__name__}.")
        if self.n is not None and length is not None and length != self.n:
            raise PredictionError(f"the predict dataset has {length} samples but the writer "
                                  f"was told n={self.n}.")
        n = self.n if self.n is not None else length
        padded = isinstance(getattr(loaders, "dataset", None), PaddedToWorld)
        self.save_rank(trainer.global_rank, trainer.world_size, n, padded)
        trainer.strategy.barrier("ExactlyOncePredictionWriter.rank_files")
        if trainer.is_global_zero:
            self.merge(trainer.world_size, n)
        trainer.strategy.barrier("ExactlyOncePredictionWriter.merged")
