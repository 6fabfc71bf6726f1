"""Course-only Lightning pieces for notebook 06 (and the Lightning row of ``make bench``).

* :class:`XLACPUAccelerator` and :func:`trainer_kwargs_here`: the Trainer arguments for the
  machine the course runs on. On a TPU they are the toolkit's
  :func:`tpu_helpers.tpu_lightning.trainer_kwargs`; without one, the same arguments with
  ``accelerator=XLACPUAccelerator()``, so Lightning's own TPU code path
  (``SingleDeviceXLAStrategy``, ``XLAPrecision``, ``XLACheckpointIO``) runs on the XLA:CPU
  device. This accelerator is emulation scaffolding (one device, four of Lightning's static
  methods overridden), so it lives here and not in the toolkit a TPU user copies.
* :func:`lightning_processes`, :func:`lightning_devices_table`, :func:`describe_choice`.
* :class:`LitDigits`: :class:`course.models.DigitsCNN` as a LightningModule, the class
  notebook 06 writes in two ``#@save`` cells (:class:`LitDigitsBase`, then the logged steps)
  and trains.
* :class:`DigitsData`: the LightningDataModule notebook 06 writes in its ``#@save`` cell: a
  training loader whose own ``DistributedSampler(drop_last=True)`` is built in each process
  (Lightning keeps a sampler that already is a ``DistributedSampler``), so no sample repeats.
* :class:`XLACountsCallback`: compiles, transfers and ``strategy.reduce`` calls per epoch
  and per step, written per rank to a file (:func:`read_counts`): with several processes
  the callback object in the notebook is not the one that ran.
* :func:`shard_table`, :func:`plot_compiles_per_epoch`, :func:`transfers_table`: notebook 06's
  sampler table, compile chart and logging-cost table, kept out of its cells.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd
import torch
import torch.nn.functional as F
import torch_xla.core.xla_model as xm  # importing it does not start the runtime
from lightning.pytorch.accelerators import XLAAccelerator
from torch.utils.data import DataLoader, DistributedSampler

from course.models import DigitsCNN
from tpu_helpers.checkpoint import atomic_write
from tpu_helpers.env import EnvironmentProblem, Runtime, detect_runtime, layout_for
from tpu_helpers.metrics import snapshot
from tpu_helpers.tpu_lightning import trainer_kwargs

# --------------------------------------------------------------------------- which Trainer


class XLACPUAccelerator(XLAAccelerator):
    """Lightning's ``XLAAccelerator`` on the one XLA:CPU device (``PJRT_DEVICE=CPU``).

    Lightning's own accelerator counts TPU chips, so without a TPU it reports "not
    available". This subclass answers Lightning's device questions for one XLA:CPU device;
    the rest is Lightning's TPU code, unchanged. Several devices are refused: Lightning's
    ``XLAStrategy`` would fork one process per device, and cross-process collectives crash
    on XLA:CPU (pytorch/xla issue 9089).
    """

    @staticmethod
    def is_available() -> bool:
        return os.environ.get("PJRT_DEVICE", "").upper() == "CPU"

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> int | list[int]:
        """``"auto"``, ``1``, ``"1"`` and ``[0]`` are the one device; the rest is refused."""
        if devices in ("auto", 1, "1") and not isinstance(devices, bool):
            return 1
        if isinstance(devices, list | tuple) and list(devices) == [0]:
            return [0]
        raise ValueError(
            f"devices={devices!r} cannot run on XLA:CPU: this emulation has one XLA device, "
            "use devices=1, [0] or 'auto'. Lightning's XLAStrategy would fork one process per "
            "device and cross-process collectives crash on XLA:CPU (pytorch/xla issue 9089).")

    @staticmethod
    def get_parallel_devices(devices: int | list[int]) -> list[torch.device]:
        return [torch.device("xla", 0)]

    @staticmethod
    def name() -> str:
        return "xla_cpu"


def trainer_kwargs_here(devices: Any = "auto", runtime: Runtime | None = None) -> dict[str, Any]:
    """:func:`tpu_helpers.tpu_lightning.trainer_kwargs` on a TPU; with :class:`XLACPUAccelerator`
    (``devices`` checked at once) on a machine without one."""
    rt = runtime or detect_runtime()
    if rt.has_tpu:
        return trainer_kwargs(devices)
    if not XLACPUAccelerator.is_available():
        raise EnvironmentProblem(
            "No TPU here and PJRT_DEVICE is not CPU: call "
            "tpu_helpers.env.configure_emulation(num_devices=1) before building the Trainer.")
    return trainer_kwargs(XLACPUAccelerator.parse_devices(devices),
                          accelerator=XLACPUAccelerator())


def lightning_processes(devices: Any, runtime: Runtime | None = None) -> int:
    """How many processes ``Trainer(**trainer_kwargs_here(devices)).fit`` runs: 1 for one
    device (no fork), else one per device (v2/v3: one per chip, 2 threads each)."""
    rt = runtime or detect_runtime()
    if not rt.has_tpu or devices == 1 or isinstance(devices, list | tuple):
        return 1
    return rt.layout.processes if rt.layout.world_size > 1 else 1


def describe_choice(kwargs: Mapping[str, Any], runtime: Runtime | None = None) -> str:
    """One sentence saying which accelerator the Trainer arguments name and why."""
    rt = runtime or detect_runtime()
    accel = kwargs["accelerator"]
    if isinstance(accel, XLACPUAccelerator):
        return (f"{rt.summary()}: Lightning runs its XLA code path (SingleDeviceXLAStrategy) "
                f"on the XLA:CPU device through {type(accel).__name__}, "
                f"devices={kwargs['devices']!r}.")
    return f"{rt.summary()}: Trainer(accelerator={accel!r}, devices={kwargs['devices']!r})."


def lightning_devices_table() -> pd.DataFrame:
    """What ``Trainer(accelerator="tpu", devices=...)`` means per single-host TPU."""
    rows = []
    for accel, gen, chips in [("v2-8 / v3-8", "v3", 4), ("v4-8", "v4", 4),
                              ("v5e-1 (Colab)", "v5e", 1), ("v5e-8 (Kaggle)", "v5e", 8),
                              ("v5p-8", "v5p", 4), ("v6e-1", "v6e", 1),
                              ("v6e-8", "v6e", 8)]:
        lay = layout_for(gen, chips)
        n = lay.world_size
        many = (f"XLAStrategy: {lay.processes} processes x {lay.devices_per_process} "
                "threads" if lay.devices_per_process > 1 else
                f"XLAStrategy: {lay.processes} processes")
        rows.append({"TPU": accel, 'devices="auto"': n,
                     "accepted devices": "1, [i]" if n == 1 else f"1, {n}, [0]..[{n - 1}]",
                     "devices=1 or [i]": "SingleDeviceXLAStrategy, 1 process",
                     "devices=all": "same as 1" if n == 1 else many})
    return pd.DataFrame(rows).set_index("TPU")


# --------------------------------------------------------------------------- the model


class LitDigitsBase(L.LightningModule):
    """:class:`course.models.DigitsCNN` as a LightningModule: the model, its AdamW optimizer
    and its predictions (batches are ``(x, y, ...)``); :class:`LitDigits` adds the training
    and validation steps. ``loss_logging`` is checked and saved with the other hyperparameters.
    """

    def __init__(self, lr=3e-3, weight_decay=1e-4, loss_logging="epoch"):
        super().__init__()
        if loss_logging not in ("epoch", "logger", "prog_bar"):
            raise ValueError(f"loss_logging: 'epoch', 'logger' or 'prog_bar', not {loss_logging!r}")
        self.save_hyperparameters()   # lr, weight_decay, loss_logging go into every checkpoint
        self.model = DigitsCNN()

    def forward(self, x):
        return self.model(x)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                 weight_decay=self.hparams.weight_decay)


class LitDigits(LitDigitsBase):
    """:class:`LitDigitsBase` with its training and validation steps, the loss logged as
    ``loss_logging`` says.

    Notebook 06 writes both classes in cells marked ``#@save course/lightning_demo.py`` and
    trains this one; ``tests/test_cells_match_toolkit.py`` keeps them equal. ``loss_logging``:
    ``"epoch"`` (``on_step=False, on_epoch=True, sync_dist=True``: reduced once per epoch, no
    host sync per step), ``"logger"`` (also the per-step loss for the logger only, read every
    ``log_every_n_steps``) or ``"prog_bar"`` (the common ``on_step=True, prog_bar=True,
    sync_dist=True``: a device-to-host transfer after every step and, on several devices, a
    reduce at every ``self.log`` call).
    """

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        per_step = self.hparams.loss_logging == "prog_bar"   # section 5 measures the cost
        self.log("train_loss", loss, on_step=per_step, on_epoch=True, prog_bar=True,
                 sync_dist=True)
        if self.hparams.loss_logging == "logger":   # per-step values: the logger only
            self.log("train_loss_step", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch[0])
        self.log("val_loss", F.cross_entropy(logits, batch[1]), sync_dist=True)
        accuracy = (logits.argmax(dim=1) == batch[1]).float().mean()
        self.log("val_acc", accuracy, prog_bar=True, sync_dist=True)


class DigitsData(L.LightningDataModule):
    """Notebook 06's loaders for one process (``#@save`` cell there; a test keeps them equal).

    ``train_dataloader`` runs in every process Lightning starts, where ``self.trainer`` knows
    the world size and this process's rank, and builds its own
    ``DistributedSampler(drop_last=True)``: Lightning leaves a loader alone whose sampler
    already is a ``DistributedSampler`` (``_requires_distributed_sampler`` in Lightning 2.6's
    ``trainer/connectors/data_connector.py``) and still calls its ``set_epoch``, so the ragged
    tail is dropped instead of repeated. The validation loader gets Lightning's own sampler.
    """

    def __init__(self, train_set, val_set, per_replica_batch, val_batch, seed=0):
        super().__init__()
        self.train_set, self.val_set, self.seed = train_set, val_set, seed
        self.per_replica_batch, self.val_batch = per_replica_batch, val_batch

    def train_dataloader(self):   # runs in every process: its rank and the world size are known
        sampler = DistributedSampler(self.train_set, num_replicas=self.trainer.world_size,
                                     rank=self.trainer.global_rank, shuffle=True,
                                     seed=self.seed, drop_last=True)   # drop, never repeat
        return DataLoader(self.train_set, batch_size=self.per_replica_batch, sampler=sampler,
                          drop_last=True)

    def val_dataloader(self):   # Lightning puts its own DistributedSampler here
        return DataLoader(self.val_set, batch_size=self.val_batch)


# --------------------------------------------------------------------------- measuring


def _wait(pl_module: L.LightningModule) -> None:
    if pl_module.device.type == "xla":
        xm.wait_device_ops()  # the step's device work is finished: its time is real


class XLACountsCallback(L.Callback):
    """Per epoch and per training step: what XLA did (:func:`tpu_helpers.metrics.snapshot`).

    ``epochs``: one dict per training epoch with the ``Counts`` fields, ``steps``,
    ``seconds``, ``train_seconds`` (first step start to last step end), ``reduce_calls``
    (``trainer.strategy.reduce``, what ``sync_dist=True`` calls; 0 on one device, where
    Lightning skips it), ``loader_batches`` (the length of the training loader Lightning runs)
    and ``sampler_drop_last`` (its sampler's ``drop_last``). ``step_transfers_from_device``: per
    step but an epoch's last, the device-to-host transfers from its start to the next step's
    start. With ``out_dir``, every rank writes ``counts-rankNNNNN.json`` there when training
    ends (:func:`read_counts`).
    """

    def __init__(self, out_dir: str | Path | None = None) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.epochs: list[dict[str, Any]] = []
        self.step_transfers_from_device: list[int] = []

    # Count strategy.reduce with a wrapper installed once per strategy and never swapped back:
    # Lightning stores the function in each logged metric's metadata, and a different one on
    # the next fit (same Trainer) fails its "self.log called with different arguments" check.
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        reduce = trainer.strategy.reduce
        if not hasattr(reduce, "calls"):
            def counted_reduce(*args: Any, **kwargs: Any) -> Any:
                counted_reduce.calls += 1  # type: ignore[attr-defined]
                return reduce(*args, **kwargs)

            counted_reduce.calls = 0  # type: ignore[attr-defined]
            trainer.strategy.reduce = counted_reduce  # type: ignore[method-assign]
        self._reduce = trainer.strategy.reduce

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the training loader Lightning runs (on XLAStrategy wrapped in an MpDeviceLoader,
        # whose private ``_loader`` is the DataLoader): its batches and its sampler's drop_last
        loader = getattr(trainer.train_dataloader, "_loader", trainer.train_dataloader)
        sampler = getattr(loader, "sampler", None)
        self._loader = {"loader_batches": len(loader),
                        "sampler_drop_last": bool(getattr(sampler, "drop_last", False))}
        self._start, self._time = snapshot(), time.perf_counter()
        self._reduce_start = self._reduce.calls
        self._steps, self._last, self._first_time = 0, None, None
        self._last_time = self._time

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        now = snapshot()
        if self._last is not None:
            self.step_transfers_from_device.append(
                now.transfers_from_device - self._last.transfers_from_device)
        self._last = now
        if self._first_time is None:
            self._first_time = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._steps += 1
        if batch_idx + 1 == trainer.num_training_batches:
            _wait(pl_module)
        self._last_time = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _wait(pl_module)
        counts = snapshot() - self._start
        self.epochs.append({
            "epoch": trainer.current_epoch, "steps": self._steps,
            "seconds": time.perf_counter() - self._time,
            "train_seconds": self._last_time - (self._first_time or self._last_time),
            **counts.as_dict(), "reduce_calls": self._reduce.calls - self._reduce_start,
            **self._loader})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.out_dir is None:
            return
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size,
                  "epochs": self.epochs, "step_transfers_from_device":
                  self.step_transfers_from_device}
        path = self.out_dir / f"counts-rank{trainer.global_rank:05d}.json"
        atomic_write(path, lambda f: f.write(json.dumps(record).encode()))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.epochs).set_index("epoch")


def read_counts(out_dir: str | Path) -> dict[int, XLACountsCallback]:
    """Every rank's :class:`XLACountsCallback` as its process left it, by rank."""
    ranks = {}
    for path in sorted(Path(out_dir).glob("counts-rank*.json")):
        record = json.loads(path.read_text())
        counts = XLACountsCallback()
        counts.epochs = record["epochs"]
        counts.step_transfers_from_device = record["step_transfers_from_device"]
        ranks[int(record["rank"])] = counts
    return ranks


# --------------------------------------------------------------------------- notebook 06's tables


def shard_table(samplers: Mapping[str, Callable[[int], Any]], world: int) -> pd.DataFrame:
    """What each sampler gives ``world`` processes in one epoch (``samplers[name](rank)`` builds
    rank ``rank``'s): the distinct rows per process, the samples seen twice and those left out."""
    rows = {}
    for name, make in samplers.items():
        shards = [list(make(r)) for r in range(world)]
        seen, n = sum(shards, []), len(make(0).dataset)
        rows[name] = {"rows per process": sorted({len(s) for s in shards}),
                      "repeated": len(seen) - len(set(seen)), "left out": n - len(set(seen))}
    return pd.DataFrame(rows).T


def plot_compiles_per_epoch(compiles: pd.Series) -> None:
    """A bar per epoch of XLA compiles (``XLACountsCallback.frame()["compiles"]``), epoch 0's
    in orange, titled with what the run shows."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    first, later = int(compiles.iloc[0]), compiles.iloc[1:].astype(int).tolist()
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.bar(compiles.index, compiles, color=["tab:orange"] + ["tab:blue"] * len(later))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="epoch", ylabel="XLA compiles (rank 0)",
           title=f"XLA compiles per epoch: {first} in epoch 0, then {', '.join(map(str, later))}")
    plt.tight_layout()
    plt.show()


def transfers_table(runs: Mapping[tuple[str, int], list[int]]) -> pd.DataFrame:
    """Per ``(loss_logging, refresh_rate)`` run, its steps and device-to-host transfers per step
    (each run's ``XLACountsCallback.step_transfers_from_device``)."""
    rows = {key: {"steps": len(t), "transfers/step": sum(t) / len(t)} for key, t in runs.items()}
    return pd.DataFrame(rows).T.rename_axis(["loss_logging", "refresh_rate"])
